"""Benchmark: end-to-end steps/hour of GPU recipes at η = 0 and η = 4, where each step's time goes,
the GPU telemetry keys of their metrics.jsonl, and recipes' step times against each other.

    python tools/bench/e2e_gpu.py [--recipes gsm8k_qwen2_gpu,gsm8k_qwen3_moe_gpu] [--steps 6] [--etas 0,4]
        [override ...]

Each (recipe, η) is one fresh ``python -m megatron_rl.main`` run (tools/bench/training_runs.py), one
after the other, so each has the GPU to itself. Steps/hour are over the steps after the first (its
start-up and compilation are not a step's cost). Printed per run: seconds per step, steps/hour,
mean time/train_s, time/sync_s, the engine's prefill+admit+decode seconds per step, mean GPU
utilisation (gpu/util_percent) and the largest gpu/0/mem_peak_gib; then the ratio of steps/hour
to the same recipe's first η, and with several recipes each one's seconds per step over the first
recipe's at the same η (e.g. the MoE recipe's step against the dense one's: ``--recipes
gsm8k_qwen2_gpu,gsm8k_qwen3_moe_gpu``); then every gpu/ key of the last run's metrics.jsonl. Extra
arguments are config overrides given to every run (e.g. algo.groups_per_batch=8);
``--recipe NAME`` is ``--recipes NAME``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from training_runs import train  # noqa: E402


@dataclass
class RunResult:
    recipe: str
    eta: int
    step_s: float
    train_s: float
    sync_s: float
    engine_s: float
    util: float
    peak_gib: float
    wall_s: float

    @property
    def per_hour(self) -> float:
        return 3600 / self.step_s


def summarise(recipe: str, eta: int, rows: List[Dict], wall: float) -> RunResult:
    """One run's means over the steps after the first (all of them if there is only one)."""
    steady = rows[1:] or rows
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in steady)  # noqa: E731
    engine_s = statistics.mean(sum(r.get(f"engine/{k}_s", 0.0) for k in ("prefill", "admit", "decode")) for r in steady)
    return RunResult(recipe, eta, mean("time/step_s"), mean("time/train_s"), mean("time/sync_s"), engine_s,
                     mean("gpu/util_percent"), max(r.get("gpu/0/mem_peak_gib", 0.0) for r in rows), wall)


def first_recipe_runs(results: Sequence[RunResult]) -> Dict[int, RunResult]:
    """The first recipe's run at each η: what the other recipes' step times are compared with."""
    base: Dict[int, RunResult] = {}
    for r in results:
        if r.recipe == results[0].recipe:
            base.setdefault(r.eta, r)
    return base


def ratio_lines(results: Sequence[RunResult]) -> List[str]:
    """One sentence per run of a later recipe: its step time over the first recipe's at that η."""
    base = first_recipe_runs(results)
    return [f"{r.recipe} at eta={r.eta}: {r.step_s:.2f} s/step = {r.step_s / base[r.eta].step_s:.2f}x the "
            f"{results[0].recipe} step ({base[r.eta].step_s:.2f} s) of this call"
            for r in results if r.recipe != results[0].recipe and r.eta in base]


def table(results: Sequence[RunResult]) -> List[str]:
    """The summary table: one line per run, its steps/hour against its recipe's first η and its
    step time against the first recipe's at the same η."""
    first_eta = {}
    for r in results:
        first_eta.setdefault(r.recipe, r)
    base = first_recipe_runs(results)
    width = max(len(r.recipe) for r in results)
    lines = [f"{'recipe':<{width}} {'eta':>4} {'s/step':>7} {'steps/h':>8} {'train s':>8} {'sync s':>7} {'engine s':>9} "
             f"{'GPU util%':>9} {'peak GiB':>8} {'vs 1st eta':>10} {'step vs ' + results[0].recipe:>12}"]
    for r in results:
        against = f"{r.step_s / base[r.eta].step_s:.2f}x" if r.eta in base else "-"
        lines.append(f"{r.recipe:<{width}} {r.eta:>4} {r.step_s:>7.2f} {r.per_hour:>8.0f} {r.train_s:>8.2f} "
                     f"{r.sync_s:>7.3f} {r.engine_s:>9.2f} {r.util:>9.1f} {r.peak_gib:>8.1f} "
                     f"{r.per_hour / first_eta[r.recipe].per_hour:>9.2f}x {against:>12}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=None, help="comma-separated recipes, each run at every η")
    parser.add_argument("--recipe", default="gsm8k_qwen2_gpu", help="one recipe (when --recipes is not given)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--etas", default="0,4")
    parser.add_argument("--root", default=None)
    args, overrides = parser.parse_known_args()
    recipes = (args.recipes or args.recipe).split(",")
    root = Path(args.root or tempfile.mkdtemp(prefix="e2e_gpu_"))
    results: List[RunResult] = []
    rows: List[Dict] = []
    for recipe in recipes:
        for eta in (int(e) for e in args.etas.split(",")):
            label = f"{recipe} eta={eta}"
            run_dir = root / f"run{len(results)}_{recipe}_eta{eta}"
            rows, wall = train(recipe, args.steps, eta, run_dir, overrides, label, echo=True)
            results.append(summarise(recipe, eta, rows, wall))
            print(f"{label}: {results[-1].step_s:.2f} s/step, wall {wall:.0f} s", flush=True)
    print(f"\n{', '.join(recipes)} {' '.join(overrides)}; {args.steps} steps per run, steps after the first")
    for line in table(results) + ratio_lines(results):
        print(line)
    gpu_keys = sorted(k for k in rows[-1] if k.startswith("gpu/")) if rows else []
    print("gpu/ keys in metrics.jsonl:", ", ".join(gpu_keys) or "none")
    if rows:
        print("last step's gpu/ values:", {k: round(rows[-1][k], 1) for k in gpu_keys})


if __name__ == "__main__":
    main()
