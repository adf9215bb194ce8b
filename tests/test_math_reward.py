"""The math reward (math-verify) and the MATH-500 loader on real rows: right answers in several
notations score 1, wrong ones 0, and hostile model output never crashes or stalls the pool."""

import asyncio
import json
import time
from pathlib import Path

import pytest

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.checks import validate
from megatron_rl.data.build import build_prompts
from megatron_rl.data.datasets import DatasetError, JsonlPrompts, gsm8k_final_answer
from megatron_rl.data.tokenizer import char_tokenizer, train_bpe
from megatron_rl.rewards import REWARDS, RewardRunner, gsm8k_exact, math_equal
from megatron_rl.rewards.math_verifier import (final_boxes, last_boxed, percent_number, repeating_to_fraction,
                                               unsafe_reason)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.is_dir():  # a worktree sits one level deeper than a clone
    DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
MATH500 = DATA / "math500" / "test.jsonl"
GSM8K = DATA / "gsm8k" / "test.jsonl"


def _rows(path, n=None):
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return rows if n is None else rows[:n]


def test_math_is_registered():
    assert REWARDS["math"] is math_equal


def test_reference_solutions_score_one_and_other_rows_answers_zero():
    """The first 12 MATH-500 rows: each reference solution (ending in its \\boxed answer) scores 1
    against its own answer; the next row's answer, where it differs, scores 0 (math-verify takes
    an equation x=5 as its right-hand side, so those are left out)."""
    rows = _rows(MATH500, 13)
    for row, other in zip(rows, rows[1:]):
        assert math_equal(row["solution"], row["answer"]) == 1.0, row["unique_id"]
        if other["answer"].replace(" ", "") != row["answer"].replace(" ", "") and "=" not in other["answer"]:
            assert math_equal(f"So the answer is $\\boxed{{{other['answer']}}}$.", row["answer"]) == 0.0, row["unique_id"]


# (MATH-500 row, a right answer in another notation, a wrong one)
NOTATIONS = [
    (2, "\\boxed{14/3}", "\\boxed{\\frac{3}{14}}"),                         # \frac{14}{3}
    (2, "The final answer is $\\dfrac{14}{3}$.", "The final answer is $4.6$."),
    (0, "\\boxed{(3, \\frac{\\pi}{2})}", "\\boxed{(3, \\pi)}"),               # \left( 3, \frac{\pi}{2} \right)
    (7, "\\boxed{90}", "\\boxed{45^\\circ}"),                                 # 90^\circ
    (184, "\\boxed{(2, \\infty)}", "\\boxed{[2, \\infty)}"),                  # (2,\infty): open vs closed
    (307, "\\boxed{(-\\infty,0]}", "\\boxed{(-\\infty, 0)}"),
    (435, "\\boxed{(3,\\infty) \\cup (-\\infty,2)}", "\\boxed{(-\\infty, 2) \\cup [3, \\infty)}"),
    (301, "\\boxed{5.4}", "\\boxed{5.5 \\text{ cents}}"),                    # 5.4 \text{ cents}
    (467, "\\boxed{15}", "\\boxed{16 \\text{ cm}^2}"),                        # 15\mbox{ cm}^2
    (1, "\\boxed{-q + p}", "\\boxed{q - p}"),                                # p - q
    (8, "\\boxed{\\sqrt{117}}", "\\boxed{3\\sqrt{12}}"),                      # 3\sqrt{13}
    (11, "\\boxed{0.0535714285714286}", "\\boxed{0.05}"),                    # \frac{3}{56}
]


@pytest.mark.parametrize("row, right, wrong", NOTATIONS)
def test_notations(row, right, wrong):
    answer = _rows(MATH500)[row]["answer"]
    assert math_equal(right, answer) == 1.0, (right, answer)
    assert math_equal(wrong, answer) == 0.0, (wrong, answer)


def test_gsm8k_rows_under_both_rewards():
    """GSM8K keeps its number match; the math reward accepts the same numbers boxed."""
    for row in _rows(GSM8K, 20):
        target = gsm8k_final_answer(row["answer"])
        assert gsm8k_exact(row["answer"], target) == 1.0
        assert math_equal(f"... so she has \\boxed{{{target}}} left.", target) == 1.0
        wrong = str(int(target) + 1)
        assert gsm8k_exact(f"#### {wrong}", target) == 0.0
        assert math_equal(f"\\boxed{{{wrong}}}", target) == 0.0


# (completion, reference, score): a percentage equals its number with or without the sign and its
# hundredth; two bare numbers and two percentages compare as written.
PERCENT = [
    ("\\boxed{50\\%}", "50", 1.0), ("\\boxed{50}", "50\\%", 1.0),
    ("\\boxed{0.5}", "50\\%", 1.0), ("\\boxed{50\\%}", "0.5", 1.0), ("\\boxed{50\\%}", "\\frac12", 1.0),
    ("\\boxed{12.5\\%}", "\\frac{1}{8}", 1.0), ("\\boxed{50 \\text{ percent}}", "50", 1.0),
    ("\\boxed{1,000\\%}", "10", 1.0), ("\\boxed{0.5\\%}", "0.5\\%", 1.0), ("The answer is 50%.", "50", 1.0),
    ("\\boxed{50}", "0.5", 0.0), ("\\boxed{50\\%}", "0.5\\%", 0.0), ("\\boxed{5\\%}", "50", 0.0),
    ("\\boxed{0.05}", "50\\%", 0.0),
]
# Repeating decimals are their fractions.
REPEATING = [
    ("\\boxed{0.\\overline{3}}", "\\frac13", 1.0), ("\\boxed{\\frac13}", "0.\\overline{3}", 1.0),
    ("\\boxed{0.\\overline{142857}}", "\\frac{1}{7}", 1.0), ("\\boxed{1.2\\overline{3}}", "\\frac{37}{30}", 1.0),
    ("\\boxed{-0.\\overline{6}}", "-\\frac23", 1.0), ("\\boxed{0.\\dot{3}}", "\\frac13", 1.0),
    ("\\boxed{0.\\overline{9}}", "1", 1.0), ("The answer is $0.\\overline{3}$.", "\\frac13", 1.0),
    ("\\boxed{0.333}", "\\frac13", 0.0), ("\\boxed{0.\\overline{3}}", "\\frac{3}{10}", 0.0),
]
# Boxes that only a separator parts are one answer list; a box further back is working.
TWO_BOXES = [
    ("\\boxed{2}, \\boxed{3}", "2, 3", 1.0), ("\\boxed{2} and \\boxed{3}", "3, 2", 1.0),
    ("$x = \\boxed{2}$ or $x = \\boxed{3}$", "2, 3", 1.0), ("x_1 = \\boxed{-1}, x_2 = \\boxed{4}", "4, -1", 1.0),
    ("\\boxed{2} gives y = 5, so \\boxed{3}", "2, 3", 0.0),   # text other than a separator between
    ("$\\boxed{2}$ \\text{ or } $\\boxed{3}$", "2,3", 1.0), ("\\boxed{2, 3}", "2, 3", 1.0),
    ("\\boxed{3}", "2, 3", 0.0), ("\\boxed{2}, \\boxed{3}", "3", 0.0),
    ("First \\boxed{1}, so the sum is 4 and \\boxed{3}", "3", 1.0),
]


@pytest.mark.parametrize("completion, target, score", PERCENT + REPEATING + TWO_BOXES)
def test_percent_repeating_decimals_and_answer_lists(completion, target, score):
    assert math_equal(completion, target) == score, (completion, target)


def test_final_boxes_percent_number_and_repeating_to_fraction():
    assert final_boxes("\\boxed{1} is wrong; \\boxed{2}, \\boxed{3}") == ["2", "3"]
    assert final_boxes("\\boxed{2}; \\boxed{\\frac{a}{b}} end") == ["2", "\\frac{a}{b}"]
    assert final_boxes("\\boxed{\\boxed{2}, \\boxed{3}}") == ["\\boxed{2}, \\boxed{3}"]
    assert final_boxes("no box") == [] and final_boxes("\\boxed{2}, \\boxed{3") == ["2"]
    assert percent_number("1,250.5\\%") == "1250.5" and percent_number("50\\% + 1") is None
    assert repeating_to_fraction("x = 0.\\overline{3} + 2.1\\bar{6}") == "x = \\frac{1}{3} + \\frac{13}{6}"


HOSTILE = [
    "\\boxed{9^{9^{9^{9}}}}",                       # a tower sympy would try to evaluate
    "\\boxed{2^{123456789}}",                       # one huge power
    "\\boxed{2**99999999}",
    "\\boxed{(10^{8})!}",
    "\\boxed{123456789!}",
    "\\boxed{" + "9" * 5000 + "}",                  # past Python's int-string limit
    "\\boxed{" + "\\frac{" * 400 + "1" + "}{2}" * 400 + "}",   # deep LaTeX
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "\\boxed{" + "{" * 20000,                       # never closed
    "x" * 1_000_000,                                # 1 MB of text
    "The answer is " + "1+" * 500_000 + "1",        # 1 MB expression
    "\\boxed{\\frac{" * 100_000,                    # 1.3 MB of unclosed boxes
    "$" * 1_000_000,
    "\x00\udcff\ufffd" * 1000 + "\\boxed{\x00}",
    "",
]


def test_hostile_output_scores_zero_fast():
    assert math_equal("\\boxed{9}", "9") == 1.0  # imports math-verify and sympy before the clock starts
    for text in HOSTILE:
        start = time.perf_counter()
        assert math_equal(text, "9") == 0.0, text[:40]
        assert time.perf_counter() - start < 5.0, text[:40]


def test_hostile_output_never_stalls_the_pool():
    """All the hostile outputs, in the reward pool with its timeout: every one scores 0 as a
    plain result (no error, no timeout), and a right answer after them still scores 1."""
    runner = RewardRunner(math_equal, workers=2, timeout_s=20.0, name="reward math")

    async def score():
        return await runner.score_many([(text, "9") for text in HOSTILE] + [("\\boxed{9}", "9")])

    try:
        assert asyncio.run(score()) == [0.0] * len(HOSTILE) + [1.0]
    finally:
        runner.close()
    assert runner.counts["ok"] == len(HOSTILE) + 1 and not runner.counts["timeout"] and not runner.counts["error"]


@pytest.mark.parametrize("answer, reason", [("9^{9^{9}}", "a power inside an exponent"),
                                            ("2^{12345}", "an exponent above"), ("2000!", "a factorial"),
                                            ("{" * 13 + "}" * 13, "nested 13 deep"), ("2^{10} + 3!", None),
                                            ("\\frac{\\sqrt{3}}{2}", None)])
def test_unsafe_reason(answer, reason):
    found = unsafe_reason(answer)
    assert (found is None) if reason is None else (reason in found)


def test_last_boxed_takes_the_last_balanced_box():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{7}") == "7" and last_boxed("\\boxed{unclosed") is None


def test_math500_loader_reads_problems_and_answers():
    tok = train_bpe((r["problem"] for r in _rows(MATH500, 50)), 512)
    prompts = JsonlPrompts(str(MATH500), tok, "problem", "answer", "math", 4096, seed=0, shuffle=False).prompts
    assert len(prompts) == 500
    assert prompts[2].target == "\\frac{14}{3}" and prompts[2].text.startswith("Problem: ")
    assert "\\boxed{}" in prompts[2].text


def test_math500_by_config_and_its_errors(tmp_path):
    cfg = load_config("tiny_cpu", ["data.name=math500", f"data.path={MATH500}", "data.max_prompt_tokens=8",
                                   "model.max_position_embeddings=64", "reward.name=math"])
    assert cfg.data.prompt_key is None
    with pytest.raises(ConfigError, match="data.path is required for data.name=math500"):
        validate(load_config("tiny_cpu", ["data.name=math500", "reward.name=math"]))
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps({"problem": "What is 1+1?", "answer": "2"}) + "\n"
                   + json.dumps({"problem": "What is 2+2?", "solution": "4"}) + "\n")
    cfg.data.path = str(bad)
    with pytest.raises(DatasetError, match=r"m.jsonl:2: missing field 'answer'"):
        build_prompts(cfg, char_tokenizer("0123456789=What is+?"))
    bad.write_text(json.dumps({"problem": "What is 1+1?", "answer": ""}) + "\n")
    with pytest.raises(DatasetError, match=r"m.jsonl:1: field 'answer' must be a non-empty string"):
        build_prompts(cfg, char_tokenizer("0123456789=What is+?"))
