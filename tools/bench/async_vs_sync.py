"""Benchmark: the same recipe with η = 0 and η = 4, side by side.

    python tools/bench/async_vs_sync.py [--steps 200] [--eta 4] [override ...]

Runs `python -m megatron_rl.main` twice (fresh processes, same seed) and prints wall time to N
steps, the final reward (mean of the last 20 steps) and the mean staleness of trained samples.
Extra arguments are config overrides applied to both runs, e.g. a long-tailed workload:
`data.min_digits=1 data.max_digits=12 rollout.max_new_tokens=14 model.max_position_embeddings=40`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(steps: int, eta: int, overrides, root: Path) -> dict:
    run_dir = root / f"eta{eta}"
    cmd = [sys.executable, "-m", "megatron_rl.main", f"trainer.total_steps={steps}",
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
        "train_s": sum(r["time/step_s"] for r in rows),
        "final_reward": sum(r["reward/mean"] for r in tail) / len(tail),
        "staleness": sum(r["staleness/mean"] for r in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eta", type=int, default=4)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(args.steps, eta, overrides, Path(tmp)) for eta in (0, args.eta)]
    print(f"{'eta':>4} {'wall s':>8} {'steps s':>8} {'final reward':>13} {'staleness':>10}")
    for r in results:
        print(f"{r['eta']:>4} {r['wall_s']:>8.1f} {r['train_s']:>8.1f} {r['final_reward']:>13.3f} {r['staleness']:>10.2f}")
    print(f"speed-up (steps time, eta=0 / eta={args.eta}): {results[0]['train_s'] / results[1]['train_s']:.2f}x")


if __name__ == "__main__":
    main()
