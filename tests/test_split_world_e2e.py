"""End to end on CPU through the real entry point: `torchrun -m megatron_rl.launch` with 4 ranks,
a TP=2 Megatron learner and 2 embedded engines on their own ranks (weights broadcast to them after
every step), runs the tiny_cpu recipe and learns."""

import json
import os
import signal
import subprocess
import sys

STEPS = 120


def test_tp2_learner_and_two_engines_learn(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "megatron_rl.launch", "recipe=tiny_cpu", "learner.tp=2", "rollout.engines=2",
           "rollout.placement=disaggregated", f"trainer.total_steps={STEPS}", f"trainer.run_dir={run_dir}",
           "trainer.progress=false", "trainer.log_interval=20"]
    # Own process group, so a hang kills torchrun and all four ranks.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"split-world run did not finish in 600 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
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
