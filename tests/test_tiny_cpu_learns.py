"""The main job, shortened: `python -m megatron_rl.main` on the tiny_cpu recipe learns clearly
and leaves an inspectable run directory."""

import json
import subprocess
import sys

STEPS = 150


def test_tiny_cpu_recipe_learns_and_leaves_a_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.main", f"trainer.total_steps={STEPS}",
         f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.log_interval=25"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"tiny_cpu {STEPS} steps: reward {first:.3f} (first 10) -> {last:.3f} (last 10)")
    assert first <= 0.2
    assert last >= first + 0.3, (first, last)

    for key in ("train/loss", "train/entropy", "train/clip_fraction", "response/length_mean",
                "response/length_max", "perf/generate_tokens_per_s", "time/step_s", "engine/prefills",
                "engine/decode_steps", "engine/rows_per_decode", "engine/decode_s", "engine/admit_s",
                "engine/prefill_s", "queue/filtered_total"):
        assert key in rows[-1]
    # The recipe is asynchronous with η = 1: samples are at most one version old, and some are.
    assert max(r["staleness/max"] for r in rows) == 1
    assert (run_dir / "config.yaml").read_text().count("total_steps: 150") == 1
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    spans = [json.loads(line)["name"] for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert {"generate", "reward", "train", "sync", "checkpoint"} <= set(spans)
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{STEPS}"
    assert (run_dir / "checkpoints" / f"step_{STEPS}" / "trainer_state.json").exists()
    assert (run_dir / "samples.jsonl").stat().st_size > 0
    assert (run_dir / "tokenizer.json").exists()
