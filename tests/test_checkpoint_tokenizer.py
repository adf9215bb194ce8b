"""A checkpoint's own tokenizer and chat template by default (data.tokenizer=auto), in training and
in eval; another tokenizer for it refused with one line unless forced; validation every
trainer.eval_interval steps logged to metrics.jsonl and TensorBoard, at the same steps after a
resume."""

import json
import shutil
from pathlib import Path

import pytest

from agent_helpers import GSM8K, write_tokenizer
from hf_helpers import save_random_hf_model

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError

GSM8K_TEST = GSM8K.parent / "test.jsonl"
SMALL_RUN = ["trainer.progress=false", "algo.group_size=2", "algo.groups_per_batch=2", "learner.mini_batches=1",
             "trainer.save_final_checkpoint=false"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random Qwen2 directory with a ChatML tokenizer (tokenizer.json, tokenizer_config.json with
    its chat template, generation_config.json), the vocabulary sized to it; offline, ~1 s."""
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    vocab = write_tokenizer(tokenizer_dir).vocab_size
    path = tmp_path_factory.mktemp("hf_with_tokenizer")
    save_random_hf_model("qwen2", path, vocab_size=vocab, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def test_training_from_a_checkpoint_uses_its_tokenizer_and_chat_template(megatron_world, hf_dir, tmp_path):
    """No data.tokenizer key: the checkpoint's tokenizer, and each GSM8K prompt (its qa instruction
    included) goes through the checkpoint's chat template."""
    from tokenizers import Tokenizer as HFTokenizer

    from megatron_rl.build import build_trainer

    cfg = load_config("tiny_cpu", [f"model.path={hf_dir}", "data.name=gsm8k", f"data.path={GSM8K}", "data.template=qa",
                                   "data.max_prompt_tokens=200", "reward.name=gsm8k", "rollout.max_new_tokens=4",
                                   "trainer.total_steps=2", f"trainer.run_dir={tmp_path}", *SMALL_RUN])
    assert cfg.data.tokenizer == "model"
    trainer = build_trainer(cfg)
    seen = []
    real_train_on = trainer.train_on
    trainer.train_on = lambda prompts, groups, version: seen.extend(prompts) or real_train_on(prompts, groups, version)
    assert trainer.run()["steps"] == 2
    backend = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert trainer.params.stop_token_ids[0] == backend.token_to_id("<|im_end|>")
    assert seen
    for prompt in seen:
        assert prompt.text == (f"<|im_start|>user\n{prompt.question}\nLet's think step by step and end with "
                               "'#### <number>'.<|im_end|>\n<|im_start|>assistant\n")
        assert prompt.prompt_ids == backend.encode(prompt.text, add_special_tokens=False).ids
    # config.yaml records the choice auto made.
    assert "tokenizer: model" in (tmp_path / "config.yaml").read_text()


def test_eval_scores_the_checkpoint_through_its_own_tokenizer(megatron_world, hf_dir, tmp_path):
    from megatron_rl.eval import evaluate

    report = evaluate([f"model.path={hf_dir}", "--datasets", "gsm8k", "--limit", "2", "--samples", "2", "--no-progress",
                       "--gsm8k", str(GSM8K_TEST), "data.max_prompt_tokens=200", "rollout.max_new_tokens=4",
                       f"trainer.run_dir={tmp_path}"])
    assert (report["tokenizer"], report["chat_template"]) == ("model", True)
    result = report["datasets"]["gsm8k"]
    assert result["problems"] == 2 and result["samples"] == 2
    assert 0.0 <= result["pass@1"] <= result["pass@2"] <= 1.0
    assert json.loads((tmp_path / "eval.json").read_text()) == report


def test_eval_scores_the_configured_dataset_and_reward_with_the_chat_template(hf_dir, tmp_path):
    """The eval's data set is built as training builds its prompts: data.name, data.template,
    data.eval_path, the run's reward, and the checkpoint's chat template."""
    from megatron_rl.data.build import build_tokenizer
    from megatron_rl.eval_sets import EvalSuite

    cfg = load_config("tiny_cpu", [f"model.path={hf_dir}", "data.name=math500",
                                   f"data.path={GSM8K.parent.parent / 'math500' / 'test.jsonl'}",
                                   f"data.eval_path={GSM8K.parent.parent / 'math500' / 'test.jsonl'}",
                                   "data.template=math", "reward.name=math", "data.max_prompt_tokens=400",
                                   "eval.datasets=[data,gsm8k]", "eval.limit=3", f"eval.gsm8k_path={GSM8K_TEST}"])
    tokenizer = build_tokenizer(cfg)
    suite = EvalSuite(cfg, tokenizer)
    data, gsm8k = suite.sets
    assert [len(data.prompts), len(gsm8k.prompts)] == [3, 3]
    assert data.reward_label == "reward math" and gsm8k.reward_label == "reward gsm8k"
    assert data.prompts[0].text.startswith("<|im_start|>user\n") and "\\boxed{}" in data.prompts[0].text
    assert gsm8k.prompts[0].text.endswith("'#### <number>'.<|im_end|>\n<|im_start|>assistant\n")
    suite.close()


@pytest.mark.parametrize("choice", ["bpe", "char"])
def test_another_tokenizer_for_a_checkpoint_with_its_own_is_one_line(hf_dir, choice):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_cpu", [f"model.path={hf_dir}", f"data.tokenizer={choice}"])
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"data.tokenizer={choice} with model.path=")
    assert "which has its own tokenizer" in text and "data.force_tokenizer=true" in text
    forced = load_config("tiny_cpu", [f"model.path={hf_dir}", f"data.tokenizer={choice}", "data.force_tokenizer=true"])
    assert forced.data.tokenizer == choice


def test_a_tokenizer_path_with_another_vocabulary_is_refused(hf_dir, tmp_path):
    write_tokenizer(tmp_path / "other", vocab_size=600)
    with pytest.raises(ConfigError, match="has another vocabulary than the tokenizer of model.path"):
        load_config("tiny_cpu", [f"model.path={hf_dir}", f"data.tokenizer_path={tmp_path / 'other'}"])
    # The same files elsewhere are the same tokenizer.
    shutil.copytree(hf_dir, tmp_path / "copy")
    assert load_config("tiny_cpu", [f"model.path={hf_dir}",
                                    f"data.tokenizer_path={tmp_path / 'copy'}"]).data.tokenizer == "model"


def test_a_small_tokenizer_for_a_pretrained_vocabulary_is_refused(tmp_path):
    """A checkpoint without tokenizer files but with a pretrained-size vocabulary: tiny_cpu's
    14-id character tokenizer would feed its ids to a 40,000-row embedding."""
    from megatron_rl.build import build_trainer
    from megatron_rl.errors import ConfigError
    from megatron_rl.models.pretrained import check_vocabulary

    save_random_hf_model("llama", tmp_path / "hf", vocab_size=40000, hidden_size=8, intermediate_size=8,
                         num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    cfg = load_config("tiny_cpu", [f"model.path={tmp_path / 'hf'}", f"trainer.run_dir={tmp_path / 'run'}"])
    assert cfg.data.tokenizer == "char"  # no tokenizer beside the weights: the task's own
    with pytest.raises(ConfigError, match=r"the tokenizer has 14 ids but model.path=.* has a pretrained vocabulary "
                                          r"of 40000: its ids would select embedding rows trained for other tokens"):
        build_trainer(cfg)  # refused once the tokenizer is built, before any model
    cfg.data.force_tokenizer = True
    check_vocabulary(cfg, 14)


def test_eval_of_a_checkpoint_without_a_tokenizer_is_refused(tmp_path, capsys):
    from megatron_rl.eval import main

    save_random_hf_model("llama", tmp_path / "hf")
    assert main([f"model.path={tmp_path / 'hf'}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "has no tokenizer (tokenizer.json), so the tokens it was trained with are unknown" in err


def _rows(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_validation_every_n_steps_is_logged_at_those_steps_and_after_a_resume(megatron_world, tmp_path):
    """tiny_cpu with trainer.eval_interval=2, asynchronous (η = 1): eval/ metrics at steps 2 and 4
    only, in metrics.jsonl and TensorBoard; the run stopped at step 2 and resumed evaluates at 4."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rl.build import build_trainer

    common = [f"trainer.run_dir={tmp_path}", "trainer.eval_interval=2", "eval.limit=6", "eval.samples=2",
              "algo.group_size=4", "algo.groups_per_batch=4", "learner.mini_batches=1", "trainer.progress=false",
              "scheduler.max_staleness=1"]
    build_trainer(load_config("tiny_cpu", [*common, "trainer.total_steps=2"])).run()
    # Resumes from step 2 (no second checkpoint: one process saves with one learner's writer).
    build_trainer(load_config("tiny_cpu", [*common, "trainer.total_steps=4", "trainer.save_final_checkpoint=false"])).run()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    evaluated = [r["step"] for r in rows if "eval/pass@1" in r]
    assert evaluated == [2, 4]
    for row in rows:
        if row["step"] in evaluated:
            assert 0.0 <= row["eval/data/pass@1"] <= row["eval/data/pass@2"] <= 1.0
            assert row["eval/pass@1"] == row["eval/data/pass@1"] and row["time/eval_s"] > 0
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [e.step for e in events.Scalars("eval/pass@1")] == [2, 4]
    spans = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert sorted(s["step"] for s in spans if s["name"] == "eval") == [2, 4]


def test_validation_of_a_jsonl_dataset_needs_a_held_out_file():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_cpu", ["data.name=gsm8k", f"data.path={GSM8K}", "trainer.eval_interval=5"])
    assert str(err.value).startswith("eval.datasets=[data] scores a held-out set of the run's dataset: set "
                                     "data.eval_path=<jsonl>")
    cfg = load_config("tiny_cpu", ["data.name=gsm8k", f"data.path={GSM8K}", "trainer.eval_interval=5",
                                   f"data.eval_path={GSM8K_TEST}"])
    assert cfg.trainer.eval_interval == 5


def test_the_math500_training_example_of_the_rewards_page_builds_its_prompts(hf_dir):
    """docs/rewards.md's command, as written, with a checkpoint directory of its own."""
    import re
    import shlex

    from megatron_rl.data.build import build_data

    page = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    command = re.search(r"^\.venv/bin/python -m megatron_rl\.main (recipe=gsm8k_qwen2_gpu .*?)\n```", page, re.M | re.S).group(1)
    args = [a.replace("/ckpt/my-model", str(hf_dir)).replace("../shared/data", str(GSM8K.parent.parent))
            for a in shlex.split(command.replace("\\\n", " "))]
    recipe, overrides = args[0].split("=", 1)[1], args[1:]
    cfg = load_config(recipe, overrides)
    tokenizer, prompts = build_data(cfg)
    assert cfg.data.tokenizer == "model" and len(prompts.prompts) > 400  # most of MATH-500 fits its budget
    assert prompts.prompts[0].text.startswith("<|im_start|>user\n")
