"""`tiny_cpu` with LoRA learns: rank-8 adapters on every projection of the frozen random base
(std 0.1, so the frozen output layer leaves room for confident logits; docs/lora.md) raise the
reward clearly in a short on-policy run, with the engine running the adapters (unmerged)."""

import json
import subprocess
import sys

STEPS = 60


def test_tiny_cpu_learns_with_lora(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.main", "lora.rank=8", "learner.lr=1e-2", "learner.min_lr=1e-3",
         "model.init_method_std=0.1", f"trainer.total_steps={STEPS}", f"trainer.run_dir={run_dir}",
         "trainer.progress=false", "trainer.save_final_checkpoint=false", "scheduler.max_staleness=0"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"tiny_cpu with LoRA, {STEPS} steps: reward {first:.3f} (first 10) -> {last:.3f} (last 10)")
    # Measured 0.044 -> 0.19 at this seed; 100 steps over three seeds in docs/lora.md.
    assert last >= first + 0.08, (first, last)
    # On-policy, the engine carrying the adapters: the learner scores the engine's tokens alike.
    assert max(r["train/behav_logprob_gap"] for r in rows) < 1e-4
