"""Exact resume: a run killed at a random step and started again on the same run directory
produces the uninterrupted run's rewards and losses step for step (η = 0); an unreadable newest
checkpoint is skipped with a warning; the pieces (random states, prompt stream position, the
ledger's unfinished prompts) round-trip."""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.checkpoint.resume import (CountingIterator, ResumeError, capture_rng, checkpoints_newest_first,
                                           load_newest_good, restore_rng)
from megatron_rl.data.datasets import Prompt
from megatron_rl.scheduler.ledger import PromptLedger
from megatron_rl.scheduler.staleness import StalenessManager
from world_runs import alive_after, descendants

COMPARED = ("reward/mean", "train/loss", "train/entropy", "train/grad_norm", "response/length_mean")


def _cmd(run_dir: Path, steps: int, *extra: str, eta: int = 0):
    return [sys.executable, "-m", "megatron_rl.main", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
            "trainer.progress=false", f"scheduler.max_staleness={eta}", "algo.groups_per_batch=8", "algo.group_size=8",
            "trainer.checkpoint_interval=3", *extra]


def _rows(run_dir: Path):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("eta, extra", [(0, ()), (1, ()), (0, ("lora.rank=8", "learner.lr=1e-2"))],
                         ids=["0", "1", "0-lora"])
def test_killed_run_resumes_exactly(tmp_path, eta, extra):
    """At η = 0 the resumed run equals the uninterrupted one step for step (also with LoRA: the
    checkpoint holds the adapters and their Adam state). At η = 1 rollouts in flight at the
    checkpoint are generated again after the resume (their prompts were saved), so it is a
    different (equally valid) run: it must finish every step once."""
    steps = 12
    # The uninterrupted reference runs beside the killed run (η = 0 is deterministic whatever
    # else the cores are doing): the two interpreters' imports, one core each, overlap.
    ref_log = tmp_path / "ref.stderr"
    with ref_log.open("w") as log:
        reference = subprocess.Popen(_cmd(tmp_path / "ref", steps, *extra), stdout=subprocess.DEVNULL,
                                     stderr=log) if eta == 0 else None
    try:
        _kill_and_resume(tmp_path, steps, eta, reference, ref_log, extra)
    finally:
        if reference is not None and reference.poll() is None:
            reference.kill()
            reference.wait()


def _kill_and_resume(tmp_path: Path, steps: int, eta: int, reference, ref_log: Path, extra=()) -> None:
    kill_after = random.randint(4, 10)  # a step past at least one checkpoint
    print(f"killing after step {kill_after}")
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(run_dir, steps, *extra, eta=eta), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while len(_rows(run_dir)) < kill_after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    children = descendants(proc.pid)  # e.g. megatron-core's checkpoint writer process
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(_rows(run_dir))
    assert kill_after <= done < steps, f"the run was not killed mid-way ({done} steps written)"
    assert not alive_after(children, 10), "a process of the killed trainer outlived it"

    resumed = subprocess.run(_cmd(run_dir, steps, *extra, eta=eta), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr
    got = _rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # steps past the checkpoint were redone, once
    if eta:
        return
    assert reference.wait(timeout=600) == 0, ref_log.read_text()[-2000:]
    for a, b in zip(_rows(tmp_path / "ref"), got):
        for key in COMPARED:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_unreadable_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    # The second run goes on to step 8: a constant lr keeps steps 5-6 comparable (a decay would
    # follow trainer.total_steps).
    extra = ("trainer.checkpoint_interval=2", "trainer.checkpoint_keep=3", "learner.lr_decay_style=constant")
    first = subprocess.run(_cmd(tmp_path, 6, *extra),
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in checkpoints_newest_first(ckpts)] == ["step_6", "step_4", "step_2"]
    for shard in (ckpts / "step_6").glob("*.distcp"):  # a crash of the disk, not of our save
        shard.write_bytes(shard.read_bytes()[:100])
    before = _rows(tmp_path)

    second = subprocess.run(_cmd(tmp_path, 8, *extra),
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "step_6 cannot be loaded" in second.stderr and "falling back to step_4" in second.stderr
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for a, b in zip(before[4:6], rows[4:6]):  # steps 5 and 6, done again from step 4's checkpoint
        assert all(a[k] == b[k] for k in COMPARED), a["step"]


def test_no_loadable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "trainer_state.json").write_text("{truncated")
    with pytest.raises(ResumeError, match="start a new run directory"):
        load_newest_good(tmp_path, lambda path: {})
    assert load_newest_good(tmp_path / "none", lambda path: {}) is None


def test_random_states_round_trip():
    state = json.loads(json.dumps(capture_rng()))  # as stored in trainer_state.json
    a = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_prompt_stream_position():
    stream = CountingIterator(iter(range(100)))
    taken = [next(stream) for _ in range(7)]
    again = CountingIterator(iter(range(100)))
    again.skip(stream.drawn)
    assert taken == list(range(7)) and next(again) == 7


def _ledger(prompts):
    return PromptLedger(iter(prompts), StalenessManager(2, 2, 64))


def test_ledger_keeps_unfinished_prompts_first():
    prompts = [Prompt(f"p{i}", str(i), [i], str(i)) for i in range(20)]
    ledger = _ledger(prompts)
    tickets = [ledger.admit(0) for _ in range(6)]
    for t in tickets[:4]:
        ledger.finish(t, [])
    batch = ledger.take_batch(0)  # p0, p1 trained; p2, p3 buffered; p4, p5 running
    assert [g.ticket.prompt.uid for g in batch] == ["p0", "p1"]
    ledger.fail(ledger.running[tickets[4].index], "aborted")  # p4 waits to be retried
    state = json.loads(json.dumps(ledger.state_dict()))

    resumed = _ledger(prompts[6:])  # the stream is already past the six drawn prompts
    resumed.load_state_dict(state)
    assert [p.uid for p in resumed.retry_queue] == ["p4", "p5", "p2", "p3"]
    assert resumed.balanced()
    assert resumed.staleness.accepted == 2 and resumed.staleness.running == 0
    order = [resumed.admit(1).prompt.uid for _ in range(5)]
    assert order == ["p4", "p5", "p2", "p3", "p6"]


@pytest.mark.parametrize("how", ["signal", "file"])
def test_stop_request_checkpoints_and_exits_3_then_resumes(tmp_path, how):
    """What Slurm's preemption warning triggers: SIGUSR1 to the trainer, or the stop file the
    sbatch script writes."""
    from megatron_rl.stop import STOP_FILE, STOPPED_EXIT

    cmd = _cmd(tmp_path, 200, "trainer.checkpoint_interval=0", eta=1)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while len(_rows(tmp_path)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if how == "signal":
        proc.send_signal(signal.SIGUSR1)
    else:
        (tmp_path / STOP_FILE).touch()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == STOPPED_EXIT, err[-2000:]
    stopped_at = len(_rows(tmp_path))
    assert f"stopped on request after step {stopped_at}" in err and stopped_at < 200
    assert (tmp_path / "checkpoints" / f"step_{stopped_at}").is_dir()

    (tmp_path / STOP_FILE).unlink(missing_ok=True)
    resumed = subprocess.run(_cmd(tmp_path, stopped_at + 3, eta=1), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {tmp_path}/checkpoints/step_{stopped_at}" in resumed.stderr
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, stopped_at + 4))
