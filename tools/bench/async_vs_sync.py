"""Benchmark: one recipe with η = 0 (synchronous) and η = 4 (asynchronous), side by side.

    python tools/bench/async_vs_sync.py [--recipe longtail_cpu] [--steps 200] [--eta 4] [--repeats 1] [override ...]
    python tools/bench/async_vs_sync.py --ranks 4 --recipe tiny_cpu learner.tp=2 rollout.engines=2 \
        rollout.placement=disaggregated          # the same pair as a torchrun world of 4 ranks

Runs `python -m megatron_rl.main` once per η (fresh processes, same seed, one after the other so
they do not share cores) and prints, for each: its wall time (the η > 0 run's includes the extra
steps below), the seconds of its first N steps, the final reward (mean of steps N-19..N, with its
standard error), the mean and the mean per-batch longest response length,
the mean staleness of trained samples, how busy the engine was, the seconds per step a finished
batch was held for an older running group (``time/learner_held_s``, ``scheduler.overdue=wait``)
and the groups dropped as too stale (``queue/returned_stale_total``, ``scheduler.overdue=retry``). The default workload,
recipes/longtail_cpu.yaml, has long-tailed response lengths. Extra arguments are config overrides
applied to both runs.

It also prints where a step's time goes, per step after the first five: generation (η = 0: the
learner's wait for its batch; η > 0: the engine's compute, on its own core) and training. An
asynchronous step cannot be shorter than its slower side, so on a CPU split between learner and
engine the speed-up is at most (gen₀ + train₀) / max(gen_η, train_η); the table shows that ceiling
next to the measured ratio. A shared or throttling machine can change a run's speed by a quarter
from one minute to the next: --repeats R runs the pair R times, alternating, and reports the
median ratio.

At equal reward: the η > 0 run goes on for --extra × N more steps (their time is not in its
"steps s"), and the table gives, for both runs, the seconds of steps until the mean reward of 20
consecutive steps first reaches R0, η = 0's final reward ("to R0 s"; inf if never). Their ratio is
the speed-up at equal reward: a stale run that learns a little less per step pays for it there.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from training_runs import train


WINDOW = 20  # steps in the "final reward" mean


def rolling_reward(rows: list, window: int) -> np.ndarray:
    """Mean reward of the ``window`` steps ending at each step, from step ``window`` on."""
    rewards = np.array([r["reward/mean"] for r in rows])
    return np.convolve(rewards, np.ones(window) / window, mode="valid")


def time_to_reward(rows: list, target: float) -> float:
    """Seconds of steps until the mean reward of WINDOW consecutive steps (all of them in a
    shorter run) first reaches ``target``; inf if it never does."""
    window = min(WINDOW, len(rows))
    reached = np.flatnonzero(rolling_reward(rows, window) >= target - 1e-12)
    if not reached.size:
        return float("inf")
    return float(sum(r["time/step_s"] for r in rows[: reached[0] + window]))


def run(recipe: str, steps: int, eta: int, overrides, root: Path, repeat: int = 0, extra: int = 0,
        ranks: int = 1) -> dict:
    """One run; ``extra`` steps past ``steps`` are only used to find when it reaches a reward."""
    all_rows, wall = train(recipe, steps + extra, eta, root / f"eta{eta}-{repeat}", overrides, f"eta={eta}",
                           ranks=ranks)
    rows = all_rows[:steps]
    tail = rows[-WINDOW:]
    steady = rows[5:] or rows
    if eta == 0:
        generate = np.mean([r.get("time/learner_wait_s", r.get("time/generate_s", 0.0)) for r in steady])
    else:
        generate = np.mean([sum(r.get(f"engine/{k}_s", 0.0) for k in ("prefill", "admit", "decode")) for r in steady])
    rewards = [r["reward/mean"] for r in tail]
    return {
        "eta": eta,
        "rows": all_rows,
        "wall_s": wall,
        "steps_s": sum(r["time/step_s"] for r in rows),
        "final_reward": float(np.mean(rewards)),
        "reward_se": float(np.std(rewards) / np.sqrt(len(rewards))),
        "generate_s": float(generate),
        "train_s": float(np.mean([r["time/train_s"] for r in steady])),
        "length": float(np.mean([r["response/length_mean"] for r in rows])),
        "longest": float(np.mean([r["response/length_max"] for r in rows])),
        "staleness": float(np.mean([r["staleness/mean"] for r in rows])),
        "busy": rows[-1]["engine/busy_fraction"],
        "held_s": float(np.mean([r.get("time/learner_held_s", 0.0) for r in steady])),
        "stale_drops": rows[-1].get("queue/returned_stale_total", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="longtail_cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eta", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="run the pair this many times, alternating")
    parser.add_argument("--ranks", type=int, default=1,
                        help="run each as a torchrun world of this many ranks (megatron_rl.launch)")
    parser.add_argument("--extra", type=float, default=0.25,
                        help="the eta>0 run goes on for this fraction of --steps more, to find when its "
                             "reward reaches eta=0's final reward (its figures at --steps ignore them)")
    args, overrides = parser.parse_known_args()
    extra = round(args.extra * args.steps)
    # Both runs follow the schedule of an N-step run (the eta>0 run's extra steps stay at min_lr).
    overrides = [f"learner.lr_decay_steps={args.steps}", *overrides]
    with tempfile.TemporaryDirectory() as tmp:
        pairs = [[run(args.recipe, args.steps, 0, overrides, Path(tmp), k, ranks=args.ranks),
                  run(args.recipe, args.steps, args.eta, overrides, Path(tmp), k, extra, ranks=args.ranks)]
                 for k in range(args.repeats)]
    print(f"recipe={args.recipe} steps={args.steps} ranks={args.ranks} {' '.join(overrides)}")
    print(f"{'eta':>4} {'wall s':>8} {'steps s':>8} {'final reward':>15} {'to R0 s':>8} {'resp len':>9} "
          f"{'longest':>8} {'staleness':>10} {'engine busy':>12} {'gen s/step':>11} {'train s/step':>13} "
          f"{'held s/step':>12} {'stale drops':>12}")
    ratios, matched, ceilings = [], [], []
    for sync, other in pairs:
        target = sync["final_reward"]  # R0: what eta=0 reached in --steps steps
        for r in (sync, other):
            reward = f"{r['final_reward']:.3f}±{r['reward_se']:.3f}"
            print(f"{r['eta']:>4} {r['wall_s']:>8.1f} {r['steps_s']:>8.1f} {reward:>15} "
                  f"{time_to_reward(r['rows'], target):>8.1f} "
                  f"{r['length']:>9.1f} {r['longest']:>8.1f} {r['staleness']:>10.2f} {r['busy']:>12.2f} "
                  f"{r['generate_s']:>11.3f} {r['train_s']:>13.3f} {r['held_s']:>12.3f} {r['stale_drops']:>12.0f}")
        ratios.append(sync["steps_s"] / other["steps_s"])
        matched.append(time_to_reward(sync["rows"], target) / time_to_reward(other["rows"], target))
        ceilings.append((sync["generate_s"] + sync["train_s"]) / max(other["generate_s"], other["train_s"], 1e-9))
    spread = lambda xs: f" (runs: {', '.join(f'{x:.2f}' for x in xs)})" if len(xs) > 1 else ""  # noqa: E731
    print(f"speed-up (time to {args.steps} steps, eta=0 / eta={args.eta}): {np.median(ratios):.2f}x{spread(ratios)}; "
          f"overlap ceiling from the split above: {np.median(ceilings):.2f}x")
    print(f"speed-up at equal reward (time until the {WINDOW}-step mean reward reaches eta=0's final reward R0): "
          f"{np.median(matched):.2f}x{spread(matched)}")


if __name__ == "__main__":
    main()
