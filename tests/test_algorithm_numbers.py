"""Every algorithm's numbers, step for step, against values saved in tests/data/algorithm_numbers.json.

Each case trains tiny_cpu for three synchronous steps (η = 0) in this process and compares the
rewards, losses, gradient norms and the other per-step metrics with the saved ones (within 1e-6,
relative above 1). The file is written by ``python tests/test_algorithm_numbers.py --write``: a
change that moves these numbers on purpose rewrites it in the same commit, and says why. The
torchrun worlds reproduce the one-process numbers (tests/test_world.py, TP=2 with a critic and a
KL in the reward among them), so these cover them too.
"""

import json
import math
import sys
from pathlib import Path

import pytest

NUMBERS = Path(__file__).parent / "data" / "algorithm_numbers.json"
COMMON = ["recipe=tiny_cpu", "trainer.total_steps=3", "scheduler.max_staleness=0", "algo.group_size=4",
          "algo.groups_per_batch=4", "learner.mini_batches=2", "trainer.progress=false",
          "trainer.save_final_checkpoint=false", "rollout.seed_by_request=true"]
CASES = {
    "grpo_ppo_entropy": [],
    "grpo_decoupled_dual_clip": ["algo.policy_loss=decoupled", "algo.dual_clip=3"],
    "grpo_decoupled_sequence_weight": ["algo.policy_loss=decoupled", "algo.behav_weight_level=sequence"],
    "grpo_kl_in_loss": ["algo.kl_coef=0.05", "algo.kl_estimator=k3"],
    "grpo_kl_in_reward": ["algo.kl_coef=0.05", "algo.kl_in_reward=true", "algo.kl_estimator=k1"],
    "dr_grpo": ["algo.name=dr_grpo", "algo.loss_agg_mode=seq-mean-token-sum-norm"],
    "rloo_seq_mean": ["algo.name=rloo", "algo.loss_agg_mode=seq-mean-token-mean"],
    "reinforce_pp": ["algo.name=reinforce_pp"],
    "reinforce_pp_baseline": ["algo.name=reinforce_pp_baseline"],
    "gspo": ["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4",
             "algo.loss_agg_mode=seq-mean-token-mean"],
    "cispo": ["algo.policy_loss=cispo", "algo.clip_low=1"],
    "gae_critic": ["algo.name=gae", "algo.kl_coef=0.01"],
}
# Per-step metrics compared (those a case logs).
KEYS = ("reward/mean", "train/loss", "train/grad_norm", "train/entropy", "train/clip_fraction", "train/approx_kl",
        "train/kl", "train/behav_logprob_gap", "critic/value_loss", "critic/grad_norm", "train/capped_fraction")


def run_case(name: str, run_dir: Path) -> list:
    from megatron_rl.main import main

    status = main([*COMMON, *CASES[name], f"trainer.run_dir={run_dir}"])
    assert status == 0, f"{name}: exit {status}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: row[k] for k in KEYS if k in row} for row in rows]


@pytest.mark.parametrize("name", list(CASES))
def test_algorithm_numbers_are_the_saved_ones(name, tmp_path):
    saved = json.loads(NUMBERS.read_text())[name]
    got = run_case(name, tmp_path)
    assert len(got) == len(saved)
    for step, (want_row, got_row) in enumerate(zip(saved, got), start=1):
        assert sorted(got_row) == sorted(want_row), (name, step)
        for key, want in want_row.items():
            have = got_row[key]
            assert math.isclose(have, want, rel_tol=1e-6, abs_tol=1e-6), (name, step, key, have, want)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    numbers = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            numbers[case] = run_case(case, Path(tmp))
        print(case, numbers[case][-1])
    NUMBERS.write_text(json.dumps(numbers, indent=1, sort_keys=True) + "\n")
