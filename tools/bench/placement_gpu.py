"""Benchmark: colocated vs disaggregated placement of the single-process trainer on one machine.

    python tools/bench/placement_gpu.py [--recipe gsm8k_qwen2_gpu] [--steps 10] [--eta 4] [override ...]
    python tools/bench/placement_gpu.py --recipe tiny_cpu --steps 3 --placements colocated   # runs on a CPU

Both placements run the embedded engine in its own process (rollout.separate_process=true) at
η = --eta; they differ only in where that process computes:
  colocated      rollout.device=auto    the learner's GPU (cuda:0): learner and engine share it
  disaggregated  rollout.device=cuda:N  GPU N (--engine-gpu, default 1): each has a GPU of its own
Each is a fresh `python -m megatron_rl.main` (same seed), one after the other. The table gives, per
placement: wall time, the mean seconds per step after --skip warm-up steps and the steps per hour
that makes, the final reward (mean of the last 5 steps), the mean staleness of trained samples,
and the mean weight-sync seconds. Extra arguments are config overrides applied to both runs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Dict, List

import numpy as np
from training_runs import train

PLACEMENTS = ("colocated", "disaggregated")


def placement_overrides(placement: str, engine_gpu: int) -> List[str]:
    device = "auto" if placement == "colocated" else f"cuda:{engine_gpu}"
    return ["rollout.separate_process=true", f"rollout.device={device}"]


def run(placement: str, args: argparse.Namespace, overrides: List[str], root: Path) -> Dict[str, float]:
    rows, wall = train(args.recipe, args.steps, args.eta, root / placement,
                       [*placement_overrides(placement, args.engine_gpu), *overrides], placement, echo=True)
    timed = rows[args.skip:] or rows  # the first steps include engine start-up and CUDA warm-up
    step_s = float(np.mean([r["time/step_s"] for r in timed]))
    return {
        "placement": placement,
        "wall_s": wall,
        "steps": len(rows),
        "step_s": step_s,
        "steps_per_hour": 3600.0 / step_s,
        "final_reward": float(np.mean([r["reward/mean"] for r in rows[-5:]])),
        "staleness": float(np.mean([r.get("staleness/mean", 0.0) for r in rows])),
        "sync_s": float(np.mean([r.get("time/sync_s", 0.0) for r in timed])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gsm8k_qwen2_gpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eta", type=int, default=4)
    parser.add_argument("--engine-gpu", type=int, default=1, help="the engine's GPU when disaggregated")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of s/step")
    parser.add_argument("--run-root", default=None,
                        help="keep each run's directory (metrics.jsonl, logs) under this folder; default: a temporary one")
    parser.add_argument("--placements", default=",".join(PLACEMENTS),
                        help="comma-separated subset of " + ", ".join(PLACEMENTS))
    args, overrides = parser.parse_known_args()
    chosen = [p for p in args.placements.split(",") if p]
    unknown = [p for p in chosen if p not in PLACEMENTS]
    if unknown or not chosen:
        parser.error(f"--placements {args.placements!r}: choose from {', '.join(PLACEMENTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.run_root) if args.run_root else Path(tmp)
        results = [run(p, args, overrides, root) for p in chosen]
    print(f"recipe={args.recipe} steps={args.steps} eta={args.eta} {' '.join(overrides)}")
    print(f"{'placement':>14} {'wall s':>8} {'s/step':>8} {'steps/hour':>11} {'final reward':>13} "
          f"{'staleness':>10} {'sync s':>7}")
    for r in results:
        print(f"{r['placement']:>14} {r['wall_s']:>8.1f} {r['step_s']:>8.2f} {r['steps_per_hour']:>11.0f} "
              f"{r['final_reward']:>13.3f} {r['staleness']:>10.2f} {r['sync_s']:>7.2f}")
    if len(results) == 2:
        print(f"disaggregated / colocated steps per hour: {results[1]['steps_per_hour'] / results[0]['steps_per_hour']:.2f}x")


if __name__ == "__main__":
    main()
