"""Rewards that misbehave: a value that is not a finite number in range is an error scored as
``reward.fallback``; a reward that hangs forever neither stops the run nor keeps the finished
process alive; the GSM8K reward reads a raw ``#### <number>`` reference."""

import asyncio
import json
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.rewards import REWARDS, RewardRunner, digit_match, gsm8k_exact

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["trainer.progress=false", "algo.group_size=4", "algo.groups_per_batch=2", "learner.mini_batches=1",
         "trainer.save_final_checkpoint=false"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), None, "1.0x", 7.0, -2.0])
def test_unusable_reward_values_are_counted_errors_scored_as_the_fallback(value, caplog):
    runner = RewardRunner(lambda c, t: 1.0 if c == "ok" else value, timeout_s=5, fallback=-0.5,
                          min_value=-1.0, max_value=1.0)
    scores = asyncio.run(runner.score_many([("ok", ""), ("bad", ""), ("ok", "")]))
    runner.close()
    assert scores == [1.0, -0.5, 1.0]
    assert runner.counts["error"] == 1 and runner.counts["ok"] == 2
    assert "reward failed on completion 'bad': returned" in caplog.text and "scored -0.5 (reward.fallback)" in caplog.text
    assert ("not a finite number" in caplog.text or "not a number" in caplog.text
            or "outside [reward.min_value, reward.max_value] = [-1.0, 1.0]" in caplog.text)


def test_gsm8k_reads_a_raw_reference_answer():
    raw = "Natalia sold 48/2 = 24 clips in May.\n#### 1,072"  # a data.name=jsonl row's answer field
    assert gsm8k_exact("so #### 1072", raw) == 1.0
    assert gsm8k_exact("so #### 1073", raw) == 0.0
    with pytest.raises(ValueError, match="is not a number and has no '#### <number>'; check data.answer_key"):
        gsm8k_exact("#### 1", "seventy two")


def test_nan_rewards_are_errors_and_the_weights_stay_finite(tmp_path):
    from megatron_rl.config import load_config
    from megatron_rl.trainer import Trainer

    def sometimes_nan(completion, target):
        return float("nan") if completion[:1] in "0123" else digit_match(completion, target)

    REWARDS.add("sometimes_nan", sometimes_nan)
    try:
        cfg = load_config("tiny_cpu", ["trainer.total_steps=2", f"trainer.run_dir={tmp_path}",
                                       "reward.name=sometimes_nan", "scheduler.max_staleness=0", *SMALL])
        trainer = Trainer(cfg)
        trainer.run()
    finally:
        REWARDS.remove("sometimes_nan")
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) == 2 and rows[-1]["reward/errors"] > 0, rows
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["reward/mean"]) for r in rows)
    params = list(trainer.worker.learner.model.parameters())
    assert params and all(torch.isfinite(p).all() for p in params)


HANGING_RUN = textwrap.dedent("""
    import sys, threading
    from megatron_rl.rewards import REWARDS, digit_match
    calls = []

    def hangs_once(completion, target):
        calls.append(1)
        if len(calls) == 3:
            threading.Event().wait()  # never returns
        return digit_match(completion, target)

    REWARDS.add("hangs_once", hangs_once)
    from megatron_rl.main import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_hanging_reward_neither_stops_the_run_nor_keeps_the_process(tmp_path):
    timeout_s = 2.0
    proc = subprocess.Popen([sys.executable, "-c", HANGING_RUN, "trainer.total_steps=3", f"trainer.run_dir={tmp_path}",
                             "reward.name=hangs_once", f"reward.timeout_s={timeout_s}", *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        summary = proc.stdout.readline()  # the run's summary: printed once the run has ended
        ended = time.monotonic()
        proc.wait(timeout=timeout_s + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(summary)["steps"] == 3
    print(f"exited {time.monotonic() - ended:.2f} s after the run ended")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward/timeouts"] == 1
    assert "timed out after 2.0s (reward.timeout_s); scored 0.0 (reward.fallback)" in stderr
