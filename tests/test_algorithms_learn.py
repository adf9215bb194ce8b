"""Each advantage estimator and policy loss trains tiny_cpu: a short run whose reward clearly
improves (GRPO with PPO clip is covered by tests/test_tiny_cpu_learns.py). The runs are on-policy
(η = 0), which is deterministic: an asynchronous run's staleness pattern depends on how busy the
machine is, and these tests are about the algorithms."""

import json
import subprocess
import sys

import pytest



# REINFORCE++ without a group baseline has the noisiest gradient: it gets more steps
# (measured: 0.04 -> 0.22 after 100 steps, -> 0.40 after 150).
@pytest.mark.parametrize("name, steps, overrides", [
    ("dr_grpo", 100, ["algo.name=dr_grpo", "algo.loss_agg_mode=seq-mean-token-sum-norm"]),  # as published
    ("rloo", 100, ["algo.name=rloo"]),
    ("reinforce_pp", 150, ["algo.name=reinforce_pp"]),
    ("reinforce_pp_baseline", 100, ["algo.name=reinforce_pp_baseline"]),
    ("gspo", 100, ["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4",
                   "algo.loss_agg_mode=seq-mean-token-mean"]),
    # CISPO: the clipped importance weight with a REINFORCE gradient, no lower bound (as published).
    ("cispo", 100, ["algo.policy_loss=cispo", "algo.clip_low=1", "algo.clip_high=0.28"]),
    # DAPO: clip-higher and token-mean are tiny_cpu's defaults; add dynamic sampling and the soft
    # overlong penalty (free up to 7 tokens, then down to -1 at 10).
    # PPO with a Megatron critic: per-token GAE advantages (γ = λ = 1, whitened).
    ("gae", 100, ["algo.name=gae"]),
    ("dapo", 100, ["algo.filter_groups=true", "rollout.max_new_tokens=10", "reward.overlong_buffer=3"]),
])
def test_tiny_cpu_learns_with(name, steps, overrides, tmp_path):
    run_dir = tmp_path / name
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.main", *overrides, f"trainer.total_steps={steps}",
         f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.save_final_checkpoint=false",
         "scheduler.max_staleness=0"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    if name == "dapo":
        assert rows[-1]["queue/filtered_total"] > 0  # all-equal groups were dropped and replaced
    if name == "gae":  # the critic learned something about the returns
        assert sum(r["critic/explained_variance"] for r in rows[-10:]) / 10 > 0.05
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"{name}, {steps} steps: reward {first:.3f} -> {last:.3f}")
    assert last >= first + 0.2, (name, first, last)
