"""End to end on CPU through the real entry point: `torchrun -m megatron_rl.launch` with 4 ranks,
a TP=2 Megatron learner and 2 embedded engines on their own ranks (weights broadcast to them after
every step), runs the tiny_cpu recipe and learns; and the colocated placement on 2 ranks."""

import json
import os
import signal
import subprocess
import sys

import pytest

STEPS = 120


def test_tp2_learner_and_two_engines_learn(tmp_path):
    run_dir = tmp_path / "run"
    cmd = ["learner.tp=2", "rollout.engines=2",
           "rollout.placement=disaggregated", f"trainer.total_steps={STEPS}", f"trainer.run_dir={run_dir}",
           "trainer.progress=false", "trainer.log_interval=20"]
    out = _torchrun(4, cmd, timeout=600)
    assert "weight-sync groups: stage 0: [0, 2, 3]" in out  # the plan it ran with
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"split world (tp2 learner + 2 engines), {STEPS} steps: reward {first:.3f} -> {last:.3f}; "
          f"{sum(r['time/step_s'] for r in rows) / STEPS:.2f} s/step; sync {rows[-1]['sync/seconds'] * 1e3:.1f} ms")
    assert last >= first + 0.2, (first, last)
    # Engines sample from exactly the weights the learner trains (on-policy, every step synced).
    assert max(r["train/behav_logprob_gap"] for r in rows) < 1e-4
    assert all(r["sync/bytes"] > 0 for r in rows)
    # Megatron dist_checkpointing ran across the two learner ranks only (engines took no part).
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{STEPS}"
    assert list((run_dir / "checkpoints" / f"step_{STEPS}").glob("*.distcp"))


@pytest.mark.parametrize("layout", ["learner.tp=2", "learner.pp=2"])
def test_colocated_engines_sample_from_the_learners_weights(tmp_path, layout):
    """Colocated on 2 ranks: each learner rank hosts an embedded engine in a child process and
    loads it with the full weights it gathers (TP shards, or the other pipeline stage) after every
    step; the engines' behaviour logprobs are then the learner's own (on-policy, gap ~0)."""
    run_dir = tmp_path / "run"
    out = _torchrun(2, [layout, "rollout.engines=2", "rollout.placement=colocated", "trainer.total_steps=4",
                        f"trainer.run_dir={run_dir}", "trainer.progress=false"], timeout=400)
    assert "weight sync: within each rank" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["train/behav_logprob_gap"] for r in rows) < 1e-4
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_4"


def _torchrun(ranks: int, overrides, timeout: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "megatron_rl.launch", "recipe=tiny_cpu", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun, its ranks and their engine processes
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun run did not finish in {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out
