"""Datasets, tokenizers and their error messages."""

import json
from pathlib import Path

import pytest

from megatron_rl.data.datasets import DatasetError, DigitTask, JsonlPrompts, gsm8k_final_answer, read_jsonl
from megatron_rl.data.tokenizer import Tokenizer, char_tokenizer, train_bpe

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def test_char_tokenizer_roundtrip_and_specials(tmp_path):
    tok = char_tokenizer("0123456789=")
    ids = tok.encode("907=")
    assert len(ids) == 4 and tok.decode(ids) == "907="
    assert tok.decode(ids + [tok.eos_id, tok.vocab_size + 3]) == "907="
    # What a reward sees hides nothing but the final EOS.
    assert tok.decode_response(ids + [tok.eos_id]) == "907="
    assert tok.decode_response(ids[:2] + [tok.pad_id, tok.vocab_size + 1] + ids[2:]) == "90<pad>\ufffd7="
    tok.save(tmp_path / "tokenizer.json")
    again = Tokenizer.load(tmp_path / "tokenizer.json")
    assert again.encode("907=") == ids and again.eos_id == tok.eos_id


def test_bpe_trains_offline():
    tok = train_bpe(["Natalia sold 48 clips #### 72"] * 50, vocab_size=300)
    text = "Natalia sold 72 clips"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text)


def test_digit_task_targets():
    tok = char_tokenizer("0123456789=")
    rev = iter(DigitTask("reverse_digits", tok, "0123456789", 3, 5, seed=0))
    srt = iter(DigitTask("sort_digits", tok, "0123456789", 3, 5, seed=0))
    for i in range(20):
        p, q = next(rev), next(srt)
        assert p.uid == f"reverse_digits-{i}" and q.uid == f"sort_digits-{i}"  # unique, in order
        digits = p.text[:-1]
        assert 3 <= len(digits) <= 5 and p.target == digits[::-1]
        assert q.target == "".join(sorted(q.text[:-1]))
        assert p.prompt_ids[0] == tok.bos_id and tok.decode(p.prompt_ids) == p.text


def test_digit_task_distinct_digits():
    tok = char_tokenizer("0123456789=")
    task = iter(DigitTask("reverse_digits", tok, "0123456789", 5, 5, seed=0, distinct=True))
    strings = [next(task).text[:-1] for _ in range(200)]
    assert all(len(set(s)) == 5 for s in strings)
    assert len(set(strings)) > 150


def test_gsm8k_sample_rows_load_with_rewardable_answers():
    from megatron_rl.rewards import gsm8k_exact

    path = str(Path(__file__).parent / "data" / "gsm8k_sample.jsonl")
    rows = read_jsonl(path, ["question", "answer"])
    tok = train_bpe((r["question"] + r["answer"] for r in rows), 400)
    prompts = JsonlPrompts(path, tok, "question", "answer", "qa", 512, seed=0, shuffle=False, gsm8k=True).prompts
    assert [p.target for p in prompts] == ["18", "3", "70000", "540", "20"]
    # The reference solution itself earns full reward; a wrong final number earns none.
    for row, prompt in zip(rows, prompts):
        assert gsm8k_exact(row["answer"], prompt.target) == 1.0
        assert gsm8k_exact("#### 123456789", prompt.target) == 0.0


@pytest.mark.skipif(not GSM8K.exists(), reason="the full GSM8K files in ../shared/data are not on this machine")
def test_gsm8k_full_split_loads():
    rows = read_jsonl(str(GSM8K / "test.jsonl"), ["question", "answer"])
    assert len(rows) == 1319
    tok = train_bpe((r["question"] for r in rows[:200]), 512)
    ds = JsonlPrompts(str(GSM8K / "test.jsonl"), tok, "question", "answer", "qa", 512, seed=0, gsm8k=True)
    first = next(iter(ds))
    assert first.target.lstrip("-").replace(".", "").isdigit()
    assert first.text.startswith("Question: ")


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("so 3+4=7\n#### 1,234") == "1234"
    with pytest.raises(ValueError):
        gsm8k_final_answer("no marker")


def test_missing_file_message(tmp_path):
    with pytest.raises(DatasetError, match=r"data.path='.*nope.jsonl': file not found"):
        read_jsonl(str(tmp_path / "nope.jsonl"), ["question"])


def _write(tmp_path, lines):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_malformed_json_names_line(tmp_path):
    path = _write(tmp_path, [json.dumps({"question": "q", "answer": "#### 1"}), "{not json"])
    with pytest.raises(DatasetError, match=r"d.jsonl:2: not valid JSON"):
        read_jsonl(path, ["question", "answer"])


def test_missing_field_names_line_and_fix(tmp_path):
    path = _write(tmp_path, [json.dumps({"question": "q", "answer": "#### 1"}), json.dumps({"prompt": "q"})])
    with pytest.raises(DatasetError) as info:
        read_jsonl(path, ["question", "answer"])
    assert "d.jsonl:2: missing field 'question' (row has: prompt); set data.prompt_key" in str(info.value)


def test_gsm8k_answer_without_marker_names_line(tmp_path):
    path = _write(tmp_path, [json.dumps({"question": "q", "answer": "42"})])
    with pytest.raises(DatasetError, match=r"d.jsonl:1: field 'answer': GSM8K answers end with"):
        JsonlPrompts(path, char_tokenizer("0123456789"), "question", "answer", "plain", 64, 0, gsm8k=True)


def test_digit_task_long_tailed_lengths():
    """length_tail draws a power law: mostly short strings, a few long ones, all within bounds."""
    tok = char_tokenizer("0123456789=")
    task = iter(DigitTask("sort_digits", tok, "0123456789", 2, 24, seed=0, length_tail=1.5))
    lengths = [len(next(task).target) for _ in range(4000)]
    assert min(lengths) == 2 and max(lengths) <= 24
    short, long = sum(n <= 4 for n in lengths), sum(n >= 16 for n in lengths)
    # P(n) ∝ (n - 1)^-1.5: P(n <= 4) ≈ 0.71, P(n >= 16) ≈ 0.07 (summed weights).
    assert 0.66 < short / 4000 < 0.76 and 0.04 < long / 4000 < 0.10, (short, long)
