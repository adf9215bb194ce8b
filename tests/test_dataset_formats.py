"""Datasets as verl and AReaL users bring them: JSONL, parquet (verl's schema) and Hugging Face
``datasets`` directories; chat-message prompts, system prompts, numeric and list answers, several
sources mixed by weight; and the one-line errors for each thing that can be wrong."""

import datetime
import json

import pytest

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.data.build import build_prompts, build_tokenizer
from megatron_rl.data.datasets import DatasetError, DatasetPrompts
from megatron_rl.data.tokenizer import char_tokenizer, write_chat_tokenizer

CHAT_TEXTS = ["What is 2+3? Add the numbers. You are a careful solver. 5 7 12 toy add",
              "system user assistant answer question"] * 20


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat_tok")
    return write_chat_tokenizer(directory, CHAT_TEXTS, 300)


def verl_rows():
    """Rows the way verl's data preprocessing scripts write them."""
    return [{"data_source": "toy/add", "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i}} for i, (a, b) in enumerate([(2, 3), (5, 7), (1, 1)])]


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_verl_parquet_is_read_as_it_is(tmp_path, chat_tokenizer):
    path = write_parquet(tmp_path / "train.parquet", verl_rows())
    prompts = DatasetPrompts(path, chat_tokenizer, None, None, "plain", 200, seed=0, shuffle=False).prompts
    first = prompts[0]
    assert first.text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert first.prompt_ids == chat_tokenizer.encode(first.text) and first.question == "What is 2+3?"
    assert [p.target for p in prompts] == ["5", "12", "2"] and first.uid == "train-0"
    assert first.row == verl_rows()[0]  # every column, nested ones included
    # The dotted key, given explicitly, reaches the same nested field.
    again = DatasetPrompts(path, chat_tokenizer, "prompt", "reward_model.ground_truth", "plain", 200, seed=0,
                           shuffle=False).prompts
    assert [p.target for p in again] == ["5", "12", "2"]


def test_hf_datasets_directory_with_integer_answers_and_splits(tmp_path):
    import datasets

    tok = char_tokenizer("0123456789=")
    rows = [{"question": "312=", "answer": 123, "level": 1}, {"question": "97=", "answer": 79, "level": 2}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    prompts = DatasetPrompts(str(tmp_path / "ds"), tok, None, None, "plain", 16, seed=0, shuffle=False).prompts
    assert [(p.target, p.ground_truth, p.row["level"]) for p in prompts] == [("123", 123, 1), ("79", 79, 2)]
    assert tok.decode(prompts[0].prompt_ids) == "312="
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    assert len(DatasetPrompts(str(tmp_path / "dd"), tok, None, None, "plain", 16, seed=0, split="test").prompts) == 2
    with pytest.raises(DatasetError, match=r"dd is a DatasetDict without a 'train' split \(it has: test\); set "
                                           r"data.split to one of them"):
        DatasetPrompts(str(tmp_path / "dd"), tok, None, None, "plain", 16, seed=0)


@pytest.mark.parametrize("answer, target, answers", [
    (42, "42", ()), (2.0, "2", ()), (0.5, "0.5", ()), ("x", "x", ()),
    (["1/2", 0.5], "1/2", ("1/2", "0.5")),  # several acceptable answers
    ([{"input": "1", "output": "2"}], '[{"input": "1", "output": "2"}]', ()),  # one structured answer
])
def test_answers_become_target_text(tmp_path, answer, target, answers):
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "1=", "answer": answer}])
    (prompt,) = DatasetPrompts(path, char_tokenizer("0123456789="), None, None, "plain", 16, seed=0).prompts
    assert (prompt.target, tuple(prompt.answers), prompt.ground_truth) == (target, answers, answer)
    assert prompt.acceptable_answers == (answers or (target,))


def test_parquet_values_are_kept_as_json(tmp_path):
    rows = [{"question": "1=", "answer": 1, "when": datetime.datetime(2026, 1, 2, 3, 4), "blob": b"\xff\x00",
             "text": b"ok"}]
    (prompt,) = DatasetPrompts(write_parquet(tmp_path / "t.parquet", rows), char_tokenizer("0123456789="), None, None,
                               "plain", 16, seed=0).prompts
    assert prompt.row["when"] == "2026-01-02T03:04:00" and prompt.row["text"] == "ok" and prompt.row["blob"] == "/wA="
    json.dumps(prompt.row)  # a checkpoint keeps it


def test_system_prompts(tmp_path, chat_tokenizer):
    rows = [{"question": "What is 2+3?", "answer": "5", "sys": "You are a careful solver."},
            {"question": "What is 1+1?", "answer": "2", "sys": ""}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    chat = DatasetPrompts(path, chat_tokenizer, None, None, "chat", 200, seed=0, shuffle=False, system_key="sys",
                          system_prompt="Add the numbers.").prompts
    assert chat[0].text.startswith("<|im_start|>system\nYou are a careful solver.<|im_end|>\n<|im_start|>user\n")
    assert chat[1].text.startswith("<|im_start|>system\nAdd the numbers.<|im_end|>")  # empty field: the config's
    plain = DatasetPrompts(path, chat_tokenizer, None, None, "plain", 200, seed=0, shuffle=False,
                           system_prompt="Add the numbers.").prompts
    assert plain[0].text == "Add the numbers.\n\nWhat is 2+3?"
    # Messages that open with their own system message keep it.
    own = [{"prompt": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "What is 2+3?"}],
            "answer": 5}]
    (prompt,) = DatasetPrompts(write_jsonl(tmp_path / "m.jsonl", own), chat_tokenizer, None, None, "plain", 200,
                               seed=0, system_prompt="Add the numbers.").prompts
    assert prompt.text.count("system") == 1 and "Mine." in prompt.text


def _config(tmp_path, *overrides):
    return load_config("tiny_cpu", ["data.name=file", f"trainer.run_dir={tmp_path}", *overrides])


def test_sources_mix_by_weight_deterministically_and_resume_where_they_were(tmp_path):
    from megatron_rl.checkpoint.resume import CountingIterator

    a = write_jsonl(tmp_path / "a.jsonl", [{"question": f"{i}=", "answer": i} for i in range(1, 8)])
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    b = write_parquet(b_dir / "a.parquet", [{"prompt": f"{i}{i}=", "ground_truth": [i, -i]} for i in range(1, 4)])
    cfg = _config(tmp_path, f"data.sources=[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]")
    tok = char_tokenizer("0123456789=-")

    def stream():
        return CountingIterator(build_prompts(cfg, tok))

    run = stream()
    drawn = [next(run).uid for _ in range(400)]
    assert drawn == [p.uid for p, _ in zip(stream(), range(400))]  # the same seed, the same stream
    from_a = sum(uid.startswith("a0-") for uid in drawn)  # two sources named a: numbered
    assert from_a + sum(uid.startswith("a1-") for uid in drawn) == 400 and 0.68 < from_a / 400 < 0.82
    resumed = stream()
    resumed.skip(250)
    assert [next(resumed).uid for _ in range(150)] == drawn[250:]
    other = _config(tmp_path, f"data.sources=[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]", "trainer.seed=7")
    assert [p.uid for p, _ in zip(build_prompts(other, tok), range(400))] != drawn


@pytest.mark.parametrize("overrides, message", [
    (["data.path=x.jsonl", "data.sources=[{path: y.jsonl}]"], "data.path and data.sources are both set"),
    (["data.sources=[{path: y.jsonl, weight: -1}]"],
     "data.sources[0].weight=-1 must be a number > 0 (weights are relative"),
    (["data.sources=[{path: y.jsonl, wieght: 2}]"],
     "data.sources[0] has unknown key 'wieght'; a source takes path, weight"),
    (["data.name=sort_digits", "data.path=x.parquet"],
     "data.path is set, but data.name=sort_digits generates its prompts; set data.name=file"),
])
def test_source_config_errors_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def _prompts(path, tokenizer=None, **kwargs):
    return DatasetPrompts(str(path), tokenizer or char_tokenizer("0123456789=abcdefghijklmnopqrstuvwxyz? "), None,
                          None, "plain", 64, seed=0, **kwargs).prompts


@pytest.mark.parametrize("rows, message", [
    ([{"text": "1=", "answer": 1}], "d.jsonl:1: no prompt field (looked for question, prompt, messages, problem; the "
                                    "row has: answer, text); set data.prompt_key=<field>"),
    ([{"question": "1=", "solution": 1}], "d.jsonl:1: no answer field (looked for answer, reward_model.ground_truth, "
                                          "ground_truth, response, completion; the row has: question, solution); set data.answer_key=<field>"),
    ([{"question": "1=", "answer": 1}, {"question": "2=", "answer": None}],
     "d.jsonl:2: field 'answer' must be a non-empty string, a number or a list of acceptable answers, got null"),
    ([{"question": "1=", "answer": 1}, {"question": 5, "answer": 1}],
     "d.jsonl:2: field 'question' must be a non-empty string or a list of chat messages ({role, content}), got 5"),
    ([{"question": [{"role": "user", "text": "hi"}], "answer": 1}],
     "d.jsonl:1: field 'question': message 0 is {\"role\": \"user\", \"text\": \"hi\"}, "
     'not {"role": <text>, "content": <text>}; fix that row'),
    ([{"question": "1=", "answer": [1, ""]}], "d.jsonl:1: field 'answer': item 1 of the answer list is empty"),
    ([{"question": [{"role": "user", "content": "hi?"}], "answer": 1}],
     "d.jsonl:1: the prompt is a list of chat messages, rendered through the tokenizer's chat template, and this "
     "tokenizer has none: use data.tokenizer=model with a model.path (or data.tokenizer_path) whose "
     "tokenizer_config.json has a chat_template"),
])
def test_malformed_rows_name_file_row_and_fix(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError) as err:
        _prompts(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_parquet_rows_are_named_by_row_and_unreadable_files_by_name(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"question": "1=", "answer": 1}, {"question": "", "answer": 1}])
    with pytest.raises(DatasetError, match=r"p.parquet row 2: field 'question' must be a non-empty string"):
        _prompts(path)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet: not a readable parquet file \(.*\); write it again"):
        _prompts(tmp_path / "bad.parquet")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DatasetError, match=r"is a directory without dataset_info.json, state.json or "
                                           r"dataset_dict.json; point it at a JSONL or parquet file"):
        _prompts(tmp_path / "empty_dir")


def test_bpe_tokenizer_trains_on_messages_and_numeric_answers(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows())
    cfg = _config(tmp_path, f"data.path={path}", "data.tokenizer=bpe", "data.bpe_vocab_size=300")
    tok = build_tokenizer(cfg)
    assert tok.decode(tok.encode("What is 5+7?")) == "What is 5+7?"
    with pytest.raises(DatasetError, match="rendered through the tokenizer's chat template, and this tokenizer has none"):
        build_prompts(cfg, tok)
