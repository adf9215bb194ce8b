"""Benchmark: end-to-end steady-state steps/hour of GPU recipes at η = 0 and η = 4, both orders of
η in one call, with the spread of step times, where each step's time goes and the GPU telemetry.

    python tools/bench/e2e_gpu.py [--recipes gsm8k_qwen2_gpu,gsm8k_qwen3_moe_gpu] [--steps 26]
        [--etas 0,4] [--order both|given] [--long-tail] [override ...]
    python tools/bench/e2e_gpu.py --recipe tiny_cpu --steps 3 --long-tail --long-tail-median 3 \
        --long-tail-p99 7 --long-tail-max 7        # a CPU smoke test of the script itself

Each (recipe, η) is one fresh ``python -m megatron_rl.main`` run (tools/bench/training_runs.py), one
after the other, so each has the GPU to itself. With ``--order both`` (the default) the η list runs
forward then backward (0, 4, 4, 0): a drift of the machine over the call (clocks, heat, another
tenant) favours neither η, and each order's ratio is printed beside the pooled one.

Steady state only (``warmup_steps``): the first ``--min-warmup`` steps (default 2: start-up,
compilation, graph capture, the first batch's prefill) are dropped, then every further leading step
slower than ``--tolerance`` (default 25 %) above the median of the steps after it; the rule is
printed, and a run with fewer than ``--min-measured`` (default 20) steps left says its ratio is not
steady-state. Printed per run: mean seconds per measured step with its min / max / standard
deviation, steps/hour, mean time/train_s, time/sync_s and the megabytes each push sent (sync/bytes:
the whole model, or under LoRA with ``lora.sync=adapters`` the adapters alone), the engine's
prefill+admit+decode seconds,
decode buckets captured during the run (``engine/late_captures``: 0 unless the engine captured on
its hot path), the mean response length, the groups returned to the prompt queue over the run
(``queue/returned_total``: failed, or too stale to train on under ``scheduler.overdue=retry``), the
mean seconds a step's finished batch was held back for an older running group
(``time/learner_held_s``, ``scheduler.overdue=wait``), GPU utilisation and peak memory; then
η ratios per step and per trained response token (equal work when the runs' lengths differ), and
with several recipes each one's step time over the first recipe's at the same η; then every gpu/
key of the last run's metrics.

``--long-tail``: the long-tail workload (rollout/long_tail.py): each response's length drawn from a
log-normal of median ``--long-tail-median`` (1,024) and 99th percentile ``--long-tail-p99``
(16,384) tokens, capped at ``--long-tail-max`` (16,384, which becomes rollout.max_new_tokens), stop
tokens ignored until then, so random weights answer with reasoning models' spread of lengths.
Extra arguments are config overrides given to every run (after the workload's, so they win), e.g.
``algo.groups_per_batch=8``; ``--recipe NAME`` is ``--recipes NAME``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from training_runs import train  # noqa: E402

# What each step's weight push took (the publish's wall time) and sent, as metrics.jsonl names them.
SYNC_S, SYNC_BYTES = "time/sync_s", "sync/bytes"


def warmup_steps(step_s: Sequence[float], min_warmup: int, tolerance: float) -> int:
    """How many leading steps are warm-up: at least ``min_warmup``, then each next step while it
    takes more than (1 + ``tolerance``) times the median of the steps after it. At least one step
    is kept (a run shorter than ``min_warmup`` + 1 keeps its last)."""
    drop = min(min_warmup, len(step_s) - 1)
    while drop < len(step_s) - 1 and step_s[drop] > (1 + tolerance) * statistics.median(step_s[drop + 1:]):
        drop += 1
    return max(drop, 0)


def warmup_rule(min_warmup: int, tolerance: float) -> str:
    return (f"warm-up excluded: the first {min_warmup} steps, then each next step slower than "
            f"{1 + tolerance:.2f}x the median of the steps after it")


@dataclass
class RunResult:
    recipe: str
    eta: int
    steps: List[float]  # measured (steady-state) step times
    warmup: int
    train_s: float
    sync_s: float
    sync_mb: float  # mean sync/bytes per push over the measured steps, in MB (0: the run logged none)
    engine_s: float
    late_captures: float
    response_len: float  # mean response tokens over the measured steps
    util: float
    peak_gib: float
    wall_s: float
    order: int = 0  # 0: in the η list's order, 1: reversed
    all_steps: List[float] = field(default_factory=list)
    # Groups returned to the prompt queue over the whole run (queue/returned_total): failed, or
    # found too stale to train on (scheduler.overdue=retry). Their generated tokens were not trained on.
    returned: float = 0.0
    # Mean seconds per measured step that a finished batch waited for an older running group
    # (time/learner_held_s, scheduler.overdue=wait): the strict staleness bound's cost.
    held_s: float = 0.0

    @property
    def step_s(self) -> float:
        return statistics.mean(self.steps)

    @property
    def std_s(self) -> float:
        return statistics.stdev(self.steps) if len(self.steps) > 1 else 0.0

    @property
    def per_hour(self) -> float:
        return 3600 / self.step_s


def summarise(recipe: str, eta: int, rows: List[Dict], wall: float, min_warmup: int, tolerance: float,
              order: int = 0) -> RunResult:
    """One run's means over its steady-state steps (``warmup_steps``)."""
    times = [r["time/step_s"] for r in rows]
    warm = warmup_steps(times, min_warmup, tolerance)
    steady = rows[warm:]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in steady)  # noqa: E731
    engine_s = statistics.mean(sum(r.get(f"engine/{k}_s", 0.0) for k in ("prefill", "admit", "decode")) for r in steady)
    return RunResult(recipe, eta, times[warm:], warm, mean("time/train_s"), mean(SYNC_S),
                     mean(SYNC_BYTES) / 1e6, engine_s,
                     sum(r.get("engine/late_captures", 0.0) for r in rows), mean("response/length_mean"),
                     mean("gpu/util_percent"),
                     max(r.get("gpu/0/mem_peak_gib", 0.0) for r in rows), wall, order, times,
                     rows[-1].get("queue/returned_total", 0.0) if rows else 0.0, mean("time/learner_held_s"))


def eta_sequence(etas: Sequence[int], order: str) -> List[Tuple[int, int]]:
    """(η, order) in run order: the list as given, then (``both``) reversed."""
    forward = [(eta, 0) for eta in etas]
    return forward + ([(eta, 1) for eta in reversed(etas)] if order == "both" else [])


def eta_ratio_lines(results: Sequence[RunResult], etas: Sequence[int]) -> List[str]:
    """Per recipe: steps/hour of each later η over the first η, in each order and pooled (the mean
    step time over both orders' measured steps); then the same per trained response token (steps/hour
    times the mean response length), which counts equal work when the η runs trained responses of
    different lengths (e.g. long ones still in flight at the end, or returned as too stale)."""
    lines = []
    for recipe in dict.fromkeys(r.recipe for r in results):
        runs = [r for r in results if r.recipe == recipe]
        for eta in etas[1:]:
            steps, tokens = [], []
            for order, name in ((0, "forward"), (1, "reversed")):
                base = [r for r in runs if r.eta == etas[0] and r.order == order]
                other = [r for r in runs if r.eta == eta and r.order == order]
                if base and other:
                    ratio = base[0].step_s / other[0].step_s
                    steps.append(f"{name} {ratio:.2f}x")
                    if base[0].response_len > 0:
                        tokens.append(f"{name} {ratio * other[0].response_len / base[0].response_len:.2f}x")
            pooled = lambda e: statistics.mean(s for r in runs if r.eta == e for s in r.steps)  # noqa: E731
            length = lambda e: statistics.mean(r.response_len for r in runs if r.eta == e)  # noqa: E731
            lines.append(f"{recipe}: eta={eta} over eta={etas[0]} steady-state steps/hour {', '.join(steps)}; "
                         f"pooled {pooled(etas[0]) / pooled(eta):.2f}x "
                         f"({pooled(etas[0]):.3f} vs {pooled(eta):.3f} s/step)")
            if tokens:
                lines.append(f"{recipe}: eta={eta} over eta={etas[0]} per trained response token {', '.join(tokens)}; "
                             f"pooled {pooled(etas[0]) / pooled(eta) * length(eta) / length(etas[0]):.2f}x "
                             f"(mean response {length(etas[0]):.1f} vs {length(eta):.1f} tokens)")
    return lines


def first_recipe_runs(results: Sequence[RunResult]) -> Dict[int, RunResult]:
    """The first recipe's first run at each η: what the other recipes' step times are compared with."""
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
    """One line per run: measured steps, mean and spread of the step time, steps/hour, where the
    time goes."""
    width = max(len(r.recipe) for r in results)
    lines = [f"{'recipe':<{width}} {'eta':>4} {'order':>5} {'warm':>4} {'meas':>4} {'s/step':>7} {'min':>6} "
             f"{'max':>6} {'std':>6} {'steps/h':>8} {'train s':>8} {'sync s':>7} {'sync MB':>8} {'engine s':>9} "
             f"{'late capt':>9} "
             f"{'resp len':>8} {'returned':>8} {'held s':>6} {'GPU util%':>9} {'peak GiB':>8}"]
    for r in results:
        lines.append(f"{r.recipe:<{width}} {r.eta:>4} {'fwd' if r.order == 0 else 'rev':>5} {r.warmup:>4} "
                     f"{len(r.steps):>4} {r.step_s:>7.3f} {min(r.steps):>6.3f} {max(r.steps):>6.3f} {r.std_s:>6.3f} "
                     f"{r.per_hour:>8.0f} {r.train_s:>8.2f} {r.sync_s:>7.3f} {r.sync_mb:>8.2f} {r.engine_s:>9.2f} "
                     f"{r.late_captures:>9.0f} {r.response_len:>8.1f} {r.returned:>8.0f} {r.held_s:>6.2f} {r.util:>9.1f} "
                     f"{r.peak_gib:>8.1f}")
    return lines


def long_tail_overrides(median: int, p99: int, cap: int) -> List[str]:
    return [f"rollout.long_tail_median={median}", f"rollout.long_tail_p99={p99}", f"rollout.max_new_tokens={cap}"]


def main(argv: Optional[Sequence[str]] = None) -> List[RunResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=None, help="comma-separated recipes, each run at every η")
    parser.add_argument("--recipe", default="gsm8k_qwen2_gpu", help="one recipe (when --recipes is not given)")
    parser.add_argument("--steps", type=int, default=26, help="steps per run, warm-up included")
    parser.add_argument("--etas", default="0,4")
    parser.add_argument("--order", choices=("both", "given"), default="both",
                        help="both: the η list forward then backward (0,4,4,0); given: once, as listed")
    parser.add_argument("--min-warmup", type=int, default=2, help="leading steps always excluded")
    parser.add_argument("--tolerance", type=float, default=0.25,
                        help="a further leading step slower than (1 + this) x the median of the rest is warm-up")
    parser.add_argument("--min-measured", type=int, default=20, help="fewer measured steps: not steady-state")
    parser.add_argument("--long-tail", action="store_true", help="the long-tail workload (rollout/long_tail.py)")
    parser.add_argument("--long-tail-median", type=int, default=1024)
    parser.add_argument("--long-tail-p99", type=int, default=16384)
    parser.add_argument("--long-tail-max", type=int, default=16384, help="rollout.max_new_tokens under --long-tail")
    parser.add_argument("--root", default=None)
    args, overrides = parser.parse_known_args(argv)
    recipes = (args.recipes or args.recipe).split(",")
    etas = [int(e) for e in args.etas.split(",")]
    if args.long_tail:
        overrides = long_tail_overrides(args.long_tail_median, args.long_tail_p99, args.long_tail_max) + overrides
    root = Path(args.root or tempfile.mkdtemp(prefix="e2e_gpu_"))
    results: List[RunResult] = []
    rows: List[Dict] = []
    for recipe in recipes:
        for eta, order in eta_sequence(etas, args.order):
            label = f"{recipe} eta={eta}"
            run_dir = root / f"run{len(results)}_{recipe}_eta{eta}"
            rows, wall = train(recipe, args.steps, eta, run_dir, overrides, label, echo=True)
            results.append(summarise(recipe, eta, rows, wall, args.min_warmup, args.tolerance, order))
            r = results[-1]
            print(f"{label}: {r.step_s:.3f} s/step over {len(r.steps)} steps after {r.warmup} warm-up, "
                  f"wall {wall:.0f} s; all steps: {' '.join(f'{s:.2f}' for s in r.all_steps)}", flush=True)
            print(f"{label}: per step sync s {' '.join(f'{x.get(SYNC_S, 0.0):.3f}' for x in rows)}; sync MB "
                  f"{' '.join(f'{x.get(SYNC_BYTES, 0.0) / 1e6:.2f}' for x in rows)}", flush=True)
    print(f"\n{', '.join(recipes)} {' '.join(overrides)}; {args.steps} steps per run; "
          f"{warmup_rule(args.min_warmup, args.tolerance)}")
    for line in table(results) + eta_ratio_lines(results, etas) + ratio_lines(results):
        print(line)
    short = [r for r in results if len(r.steps) < args.min_measured]
    if short:
        print(f"NOT steady-state: {len(short)} run(s) kept fewer than {args.min_measured} measured steps "
              f"(fewest {min(len(r.steps) for r in short)}): raise --steps")
    gpu_keys = sorted(k for k in rows[-1] if k.startswith("gpu/")) if rows else []
    print("gpu/ keys in metrics.jsonl:", ", ".join(gpu_keys) or "none")
    if rows and gpu_keys:
        print("last step's gpu/ values:", {k: round(rows[-1][k], 1) for k in gpu_keys})
    return results


if __name__ == "__main__":
    main()
