"""Each advantage estimator trains tiny_cpu: a short run whose reward clearly improves
(GRPO itself is covered by tests/test_tiny_cpu_learns.py)."""

import json
import subprocess
import sys

import pytest



# REINFORCE++ without a group baseline has the noisiest gradient: it gets more steps
# (measured: 0.04 -> 0.22 after 100 steps, -> 0.40 after 150).
@pytest.mark.parametrize("name, steps, extra", [
    ("dr_grpo", 100, ["algo.loss_agg_mode=seq-mean-token-sum-norm"]),  # Dr.GRPO as published
    ("rloo", 100, []), ("reinforce_pp", 150, []), ("reinforce_pp_baseline", 100, [])])
def test_tiny_cpu_learns_with(name, steps, extra, tmp_path):
    run_dir = tmp_path / name
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.main", f"algo.name={name}", f"trainer.total_steps={steps}", *extra,
         f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.save_final_checkpoint=false"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [json.loads(line)["reward/mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"{name}, {steps} steps: reward {first:.3f} -> {last:.3f}")
    assert last >= first + 0.2, (name, first, last)
