"""Benchmark: end-to-end steps/hour of a GPU recipe at η = 0 and η = 4, where each step's time goes,
and the GPU telemetry keys of its metrics.jsonl.

    python tools/bench/e2e_gpu.py [--recipe gsm8k_qwen2_gpu] [--steps 6] [--etas 0,4] [override ...]

Each η is one fresh ``python -m megatron_rl.main`` run (tools/bench/training_runs.py). Steps/hour
are over the steps after the first (its start-up and compilation are not a step's cost). Printed
per run: seconds per step, steps/hour, mean time/train_s, time/sync_s, the engine's
prefill+admit+decode seconds per step, mean GPU utilisation (gpu/util_percent) and the largest
gpu/0/mem_peak_gib; then the ratio of steps/hour to the first η's, and every gpu/ key of the last
run's metrics.jsonl. Extra arguments are config overrides (e.g. algo.groups_per_batch=8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from training_runs import train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gsm8k_qwen2_gpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--etas", default="0,4")
    parser.add_argument("--root", default=None)
    args, overrides = parser.parse_known_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="e2e_gpu_"))
    results = []
    rows = []
    for eta in (int(e) for e in args.etas.split(",")):
        rows, wall = train(args.recipe, args.steps, eta, root / f"eta{eta}", overrides, f"eta={eta}", echo=True)
        steady = rows[1:] or rows
        step_s = statistics.mean(r["time/step_s"] for r in steady)
        mean = lambda key: statistics.mean(r.get(key, 0.0) for r in steady)  # noqa: E731
        engine_s = statistics.mean(sum(r.get(f"engine/{k}_s", 0.0) for k in ("prefill", "admit", "decode"))
                                   for r in steady)
        results.append((eta, step_s, 3600 / step_s, mean("time/train_s"), mean("time/sync_s"), engine_s,
                        mean("gpu/util_percent"), max(r.get("gpu/0/mem_peak_gib", 0.0) for r in rows), wall))
        print(f"eta={eta}: {step_s:.2f} s/step, wall {wall:.0f} s", flush=True)
    print(f"\n{args.recipe} {' '.join(overrides)}; {args.steps} steps per run, steps after the first")
    print(f"{'eta':>4} {'s/step':>7} {'steps/h':>8} {'train s':>8} {'sync s':>7} {'engine s':>9} {'GPU util%':>9} "
          f"{'peak GiB':>8} {'vs first':>8}")
    for eta, step_s, per_hour, train_s, sync_s, engine_s, util, peak, _ in results:
        print(f"{eta:>4} {step_s:>7.2f} {per_hour:>8.0f} {train_s:>8.2f} {sync_s:>7.3f} {engine_s:>9.2f} {util:>9.1f} "
              f"{peak:>8.1f} {per_hour / results[0][2]:>7.2f}x")
    gpu_keys = sorted(k for k in rows[-1] if k.startswith("gpu/")) if rows else []
    print("gpu/ keys in metrics.jsonl:", ", ".join(gpu_keys) or "none")
    if rows:
        print("last step's gpu/ values:", {k: round(rows[-1][k], 1) for k in gpu_keys})


if __name__ == "__main__":
    main()
