"""Rewards that misbehave: a value that is not a finite number in range is an error scored as
``reward.fallback``; a wrong return type, or a reward failing for every sample of many groups,
stops the run with one line; a reward that spins, hangs in C or exits costs about
``reward.timeout_s`` in its worker process and neither stops the run, nor blocks a SIGTERM, nor
outlives the trainer; the GSM8K reward reads a raw ``#### <number>`` reference."""

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron_rl.plugins import PluginError
from megatron_rl.stop import STOPPED_EXIT
from megatron_rl.rewards import REWARDS, RewardRunner, gsm8k_exact
from megatron_rl.rewards.runner import RewardFailing
from megatron_rl.rewards.worker import as_reward, wrong_type
from reward_functions import always_raises, numpy_scalars, sometimes_nan, unusable_unless_ok, wrong_type_unless_ok

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["trainer.progress=false", "algo.group_size=4", "algo.groups_per_batch=2", "learner.mini_batches=1",
         "trainer.save_final_checkpoint=false"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "7", "-2", "1e300"])
def test_unusable_reward_values_are_counted_errors_scored_as_the_fallback(value, caplog):
    runner = RewardRunner(unusable_unless_ok, timeout_s=5, fallback=-0.5, min_value=-1.0, max_value=1.0)
    scores = asyncio.run(runner.score_many([("ok", value), ("bad", value), ("ok", value)]))
    runner.close()
    assert scores == [1.0, -0.5, 1.0]
    assert runner.counts["error"] == 1 and runner.counts["ok"] == 2
    assert "reward failed on completion 'bad': returned" in caplog.text and "scored -0.5 (reward.fallback)" in caplog.text
    assert ("not a finite number" in caplog.text
            or "outside [reward.min_value, reward.max_value] = [-1.0, 1.0]" in caplog.text)


def test_a_reward_beyond_max_abs_is_a_counted_error(caplog):
    runner = RewardRunner(unusable_unless_ok, timeout_s=5, max_abs=1e6)
    assert asyncio.run(runner.score_many([("ok", "1e300"), ("bad", "1e300")])) == [1.0, 0.0]
    runner.close()
    assert runner.counts["error"] == 1 and "returned 1e+300, beyond reward.max_abs=1000000.0" in caplog.text


@pytest.mark.parametrize("value, shown", [("none", "NoneType None"), ("text", "str '1.0x'"), ("list", "list [1.0]")])
def test_a_wrong_return_type_stops_at_the_first_call_naming_the_reward(value, shown):
    runner = RewardRunner(wrong_type_unless_ok, timeout_s=5, name="reward my_reward")
    try:
        with pytest.raises(PluginError) as err:
            asyncio.run(runner.score_many([("ok", value), ("bad", value), ("ok", value)]))
    finally:
        runner.close()
    assert str(err.value) == (f"reward my_reward returned {shown}; return a float (an int, bool, numpy or torch "
                              "scalar will do) or a dict with a float 'reward'")


def test_numpy_and_torch_scalars_and_bools_are_numbers():
    runner = RewardRunner(numpy_scalars, timeout_s=30)
    targets = ["f32", "i64", "bool", "0d", "true", "dict"]
    try:
        assert asyncio.run(runner.score_many([("x", t) for t in targets])) == [0.5, 1.0, 1.0, 0.25, 1.0, 0.75]
    finally:
        runner.close()
    # torch is not imported in the worker for this test (a worker starts faster without it).
    assert as_reward(torch.tensor(0.5)) == 0.5 and wrong_type(torch.tensor(0.5)) is None
    assert as_reward({"reward": torch.tensor(2, dtype=torch.int64)}) == 2.0
    assert wrong_type(torch.ones(2)) == "returned Tensor tensor([1., 1.])"


def test_rewards_failing_for_every_sample_of_n_groups_stop_naming_the_reward():
    runner = RewardRunner(always_raises, timeout_s=5, name="reward.fn reward_functions:always_raises",
                          max_failing_groups=3)
    try:
        for _ in range(2):
            assert asyncio.run(runner.score_many([("a", ""), ("b", "")])) == [0.0, 0.0]
        with pytest.raises(RewardFailing) as err:
            asyncio.run(runner.score_many([("a", ""), ("b", "")]))
    finally:
        runner.close()
    assert str(err.value) == (
        "reward.fn reward_functions:always_raises failed for every sample of 3 groups in a row (the last: "
        "ValueError: this reward cannot read the target); the run stopped. Fix the reward or the data: the "
        "errors are in logs/train.log")


def test_a_reward_the_workers_cannot_receive_or_load_stops_with_one_line(monkeypatch):
    with pytest.raises(PluginError, match="cannot be sent to a reward worker process .* define it at the top level"):
        RewardRunner(lambda completion, target: 1.0, name="reward local")
    # A module that exists only in this process: the function pickles here, a worker cannot import it.
    module = types.ModuleType("made_at_run_time")
    exec("def score(completion, target):\n    return 1.0", module.__dict__)
    monkeypatch.setitem(sys.modules, "made_at_run_time", module)
    runner = RewardRunner(module.score, timeout_s=30, name="reward made")
    try:
        with pytest.raises(PluginError, match="reward made cannot be loaded in a reward worker process "
                                              r"\(ModuleNotFoundError: No module named 'made_at_run_time'\)"):
            asyncio.run(runner.score("x", ""))
    finally:
        runner.close()


def test_gsm8k_reads_a_raw_reference_answer():
    raw = "Natalia sold 48/2 = 24 clips in May.\n#### 1,072"  # a data.name=jsonl row's answer field
    assert gsm8k_exact("so #### 1072", raw) == 1.0
    assert gsm8k_exact("so #### 1073", raw) == 0.0
    with pytest.raises(ValueError, match="is not a number and has no '#### <number>'; check data.answer_key"):
        gsm8k_exact("#### 1", "seventy two")


def test_nan_rewards_are_errors_and_the_weights_stay_finite(tmp_path):
    from megatron_rl.checks import load_config
    from megatron_rl.build import build_trainer

    REWARDS.add("sometimes_nan", sometimes_nan)
    try:
        cfg = load_config("tiny_cpu", ["trainer.total_steps=2", f"trainer.run_dir={tmp_path}",
                                       "reward.name=sometimes_nan", "scheduler.max_staleness=0", *SMALL])
        trainer = build_trainer(cfg)
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


def _env(state_dir: Path) -> dict:
    """The environment of a trainer whose reward.fn lives in tests/reward_functions.py."""
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "REWARD_TEST_DIR": str(state_dir), "PYTHONUNBUFFERED": "1"}


def _trainer(tmp_path: Path, reward_fn: str, timeout_s: float, *overrides: str) -> subprocess.Popen:
    state = tmp_path / "state"
    state.mkdir()
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.main", f"trainer.run_dir={tmp_path / 'run'}",
                             f"reward.fn={reward_fn}", f"reward.timeout_s={timeout_s}", *SMALL, *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(state))


def _wait_for(path: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} did not appear within {limit_s} s"
        time.sleep(0.1)


def test_spinning_regex_bound_and_exiting_rewards_cost_about_the_timeout_and_sigterm_still_stops(tmp_path):
    """A Python busy loop, a catastrophic regex (which holds the interpreter lock in C) and
    sys.exit(3), each once in the first step: the run goes on, each hang costs about
    reward.timeout_s (its worker is killed and replaced) and the exit is a counted error. Later,
    while another regex hangs, SIGTERM stops the run after that step with a checkpoint (status
    3, not the reward's exit code), and no worker process outlives it."""
    psutil = pytest.importorskip("psutil")
    timeout_s = 2.0
    state = tmp_path / "state"
    proc = _trainer(tmp_path, "reward_functions:misbehaves_once_each", timeout_s, "trainer.total_steps=500")
    try:
        _wait_for(tmp_path / "run" / "metrics.jsonl", 180)  # step 1, with its three misbehaviours, is done
        (state / "go").write_text("1")
        _wait_for(state / "regex-on-request", 60)  # a worker is in the regex now
        time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert int((state / "regex-on-request").read_text()) in [c.pid for c in children]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=180)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == STOPPED_EXIT, stderr[-3000:]  # stopped on request, checkpoint written
    assert "received SIGTERM: stopping after this step with a checkpoint" in stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward/timeouts"] == 2 and rows[0]["reward/errors"] >= 1, rows[0]
    assert "SystemExit: 3; scored 0.0 (reward.fallback)" in stderr
    # The third, the one SIGTERM came during, times out or is killed with its group at the stop.
    assert stderr.count("timed out after 2.0s (reward.timeout_s); scored 0.0 (reward.fallback)") >= 2
    step_s = [round(r["time/step_s"], 2) for r in rows]
    print(f"step times (two hangs of {timeout_s} s and an exit in step 1): {step_s}; "
          f"exited {took:.1f} s after SIGTERM")
    # Two hangs cost about 2 x timeout_s, plus a fresh worker after each kill (~1 s on a loaded
    # 2-core machine); before worker processes the busy loop took minutes and the regex forever.
    assert step_s[0] < 2 * timeout_s + 10
    # The hang, the rest of the step, a checkpoint and the exit (tens of seconds on a loaded
    # 2-core machine); before, the regex held the interpreter lock and the signal was never handled.
    assert took < timeout_s + 60
    time.sleep(0.5)
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []


KILLED_PARENT = textwrap.dedent("""
    import asyncio
    from megatron_rl.rewards import RewardRunner
    from reward_functions import spins

    if __name__ == "__main__":
        asyncio.run(RewardRunner(spins, timeout_s=600).score("x", ""))
""")


def test_a_worker_spinning_in_a_reward_dies_with_a_killed_trainer(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    # stderr: the killed parent's resource tracker reports its pool's semaphores as leaked.
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PARENT], cwd=ROOT, env=_env(state), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not list(state.glob("spin-*")):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        worker = int(next(state.glob("spin-*")).read_text())
        proc.kill()  # SIGKILL: no handler, no atexit: only the kernel can take the worker along
        proc.wait()
        deadline = time.monotonic() + 5
        while _alive(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its killed parent"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_huge_reward_skips_the_steps_it_would_poison_and_stops_with_the_weights_finite(tmp_path):
    """dr_grpo (no std normalisation) with rewards of 1e300 and reward.max_abs off: the advantages
    overflow float32 and the loss is NaN. Each such optimizer step is skipped (counted, one
    warning naming the cause), learner.max_skipped_steps in a row stop the run with one line, the
    weights stay finite and no checkpoint is written with non-finite weights."""
    from megatron_rl.checks import load_config
    from megatron_rl.checks import validate
    from megatron_rl.build import build_trainer
    from megatron_rl.trainer import TrainingStopped

    cfg = load_config("tiny_cpu", ["trainer.total_steps=6", f"trainer.run_dir={tmp_path}", "algo.name=dr_grpo",
                                   "reward.fn=reward_functions:huge", "reward.max_abs=null", "learner.max_skipped_steps=2",
                                   "scheduler.max_staleness=0", *SMALL])
    trainer = build_trainer(validate(cfg))
    with pytest.raises(TrainingStopped) as err:
        trainer.run()
    assert str(err.value) == (
        "2 optimizer steps in a row were skipped for a non-finite loss or gradient norm (learner.max_skipped_steps=2); "
        "the run stopped with the weights of the last good step. Look for a reward beyond reward.max_abs or a "
        "learning rate too high (learner.lr); the warnings are in logs/train.log")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_steps"] for r in rows][-2:] == [1.0, 1.0], rows
    log = (tmp_path / "logs" / "train.log").read_text()
    assert "policy optimizer step skipped: the loss is nan and the gradient norm is not finite" in log
    params = list(trainer.worker.learner.model.parameters())
    assert all(torch.isfinite(p).all() for p in params)
    # Belt and braces: weights that did turn non-finite are never written.
    with torch.no_grad():
        params[0].view(-1)[0] = float("nan")
    assert not trainer.worker.weights_finite()
    trainer.learner_executor = ThreadPoolExecutor(1)  # the run's own was shut down with it
    with pytest.raises(TrainingStopped, match="the weights are not finite after step 9; no checkpoint was written"):
        asyncio.run(trainer.save(9))
