"""Benchmark: one recipe with η = 0 (synchronous) and η = 4 (asynchronous), side by side.

    python tools/bench/async_vs_sync.py [--recipe longtail_cpu] [--steps 200] [--eta 4] [--repeats 1] [override ...]

Runs `python -m megatron_rl.main` once per η (fresh processes, same seed, one after the other so
they do not share cores) and prints, for each: wall time to N steps, the final reward (mean of the
last 20 steps, with its standard error), the mean and the mean per-batch longest response length,
the mean staleness of trained samples, and how busy the engine was. The default workload,
recipes/longtail_cpu.yaml, has long-tailed response lengths. Extra arguments are config overrides
applied to both runs.

It also prints where a step's time goes, per step after the first five: generation (η = 0: the
learner's wait for its batch; η > 0: the engine's compute, on its own core) and training. An
asynchronous step cannot be shorter than its slower side, so on a CPU split between learner and
engine the speed-up is at most (gen₀ + train₀) / max(gen_η, train_η); the table shows that ceiling
next to the measured ratio. A shared or throttling machine can change a run's speed by a quarter
from one minute to the next: --repeats R runs the pair R times, alternating, and reports the
median ratio.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from training_runs import train


def run(recipe: str, steps: int, eta: int, overrides, root: Path, repeat: int = 0) -> dict:
    rows, wall = train(recipe, steps, eta, root / f"eta{eta}-{repeat}", overrides, f"eta={eta}")
    tail = rows[-20:]
    steady = rows[5:] or rows
    if eta == 0:
        generate = np.mean([r.get("time/learner_wait_s", r.get("time/generate_s", 0.0)) for r in steady])
    else:
        generate = np.mean([sum(r.get(f"engine/{k}_s", 0.0) for k in ("prefill", "admit", "decode")) for r in steady])
    rewards = [r["reward/mean"] for r in tail]
    return {
        "eta": eta,
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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="longtail_cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eta", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="run the pair this many times, alternating")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        pairs = [[run(args.recipe, args.steps, eta, overrides, Path(tmp), k) for eta in (0, args.eta)]
                 for k in range(args.repeats)]
    print(f"recipe={args.recipe} steps={args.steps} {' '.join(overrides)}")
    print(f"{'eta':>4} {'wall s':>8} {'steps s':>8} {'final reward':>15} {'resp len':>9} "
          f"{'longest':>8} {'staleness':>10} {'engine busy':>12} {'gen s/step':>11} {'train s/step':>13}")
    ratios, ceilings = [], []
    for sync, other in pairs:
        for r in (sync, other):
            reward = f"{r['final_reward']:.3f}±{r['reward_se']:.3f}"
            print(f"{r['eta']:>4} {r['wall_s']:>8.1f} {r['steps_s']:>8.1f} {reward:>15} "
                  f"{r['length']:>9.1f} {r['longest']:>8.1f} {r['staleness']:>10.2f} {r['busy']:>12.2f} "
                  f"{r['generate_s']:>11.3f} {r['train_s']:>13.3f}")
        ratios.append(sync["steps_s"] / other["steps_s"])
        ceilings.append((sync["generate_s"] + sync["train_s"]) / max(other["generate_s"], other["train_s"], 1e-9))
    spread = f" (runs: {', '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
    print(f"speed-up (time to {args.steps} steps, eta=0 / eta={args.eta}): {np.median(ratios):.2f}x{spread}; "
          f"overlap ceiling from the split above: {np.median(ceilings):.2f}x")


if __name__ == "__main__":
    main()
