"""Benchmark: one recipe with η = 0 (synchronous) and η = 4 (asynchronous), side by side.

    python tools/bench/async_vs_sync.py [--recipe longtail_cpu] [--steps 200] [--eta 4] [override ...]

Runs `python -m megatron_rl.main` once per η (fresh processes, same seed, one after the other so
they do not share cores) and prints, for each: wall time to N steps, the final reward (mean of the
last 20 steps), the mean and the mean per-batch longest response length, the mean staleness of trained
samples, and how busy the engine was. The default workload, recipes/longtail_cpu.yaml, has
long-tailed response lengths. Extra arguments are config overrides applied to both runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def run(recipe: str, steps: int, eta: int, overrides, root: Path) -> dict:
    run_dir = root / f"eta{eta}"
    cmd = [sys.executable, "-m", "megatron_rl.main", f"recipe={recipe}", f"trainer.total_steps={steps}",
           f"scheduler.max_staleness={eta}", f"trainer.run_dir={run_dir}", "trainer.progress=false",
           "trainer.save_final_checkpoint=false", *overrides]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"run with eta={eta} failed:\n{result.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tail = rows[-20:]
    return {
        "eta": eta,
        "wall_s": wall,
        "steps_s": sum(r["time/step_s"] for r in rows),
        "final_reward": float(np.mean([r["reward/mean"] for r in tail])),
        "length": float(np.mean([r["response/length_mean"] for r in rows])),
        "longest": float(np.mean([r["response/length_max"] for r in rows])),
        "staleness": float(np.mean([r["staleness/mean"] for r in rows])),
        "busy": rows[-1]["engine/busy_fraction"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="longtail_cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eta", type=int, default=4)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(args.recipe, args.steps, eta, overrides, Path(tmp)) for eta in (0, args.eta)]
    print(f"recipe={args.recipe} steps={args.steps} {' '.join(overrides)}")
    print(f"{'eta':>4} {'wall s':>8} {'steps s':>8} {'final reward':>13} {'resp len':>9} "
          f"{'longest':>8} {'staleness':>10} {'engine busy':>12}")
    for r in results:
        print(f"{r['eta']:>4} {r['wall_s']:>8.1f} {r['steps_s']:>8.1f} {r['final_reward']:>13.3f} "
              f"{r['length']:>9.1f} {r['longest']:>8.1f} {r['staleness']:>10.2f} {r['busy']:>12.2f}")
    print(f"speed-up (time to {args.steps} steps, eta=0 / eta={args.eta}): "
          f"{results[0]['steps_s'] / results[1]['steps_s']:.2f}x")


if __name__ == "__main__":
    main()
