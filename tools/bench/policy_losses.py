"""Benchmark: policy losses side by side on one recipe, over several seeds.

    python tools/bench/policy_losses.py [--recipe tiny_cpu] [--steps 100] [--seeds 1,2,3] \
        [--losses "ppo;cispo:algo.clip_low=1,algo.clip_high=0.28"] [override ...]

Each entry of --losses is `name[:override,override...]`: `algo.policy_loss=name` plus its own
overrides; the extra arguments apply to every run. Runs are synchronous (η = 0, deterministic for a
seed) and one after the other (fresh processes). The table gives, per loss and seed, the mean
reward of the first and last 10 steps, then per loss the mean over seeds of the last-10 reward and
its spread (sample std over seeds). Two losses "learn alike" when their last-10 means differ by
less than the seeds' spread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from training_runs import train

WINDOW = 10


def parse_losses(spec: str):
    """[(label, overrides)] from "name[:k=v,k=v];name2..."."""
    out = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, extra = item.partition(":")
        out.append((item, [f"algo.policy_loss={name}", *filter(None, extra.split(","))]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny_cpu")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--losses", default="ppo;cispo:algo.clip_low=1,algo.clip_high=0.28")
    args, overrides = parser.parse_known_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    finals = {}
    print(f"{'loss':44s} {'seed':>4s} {'first10':>8s} {'last10':>8s} {'wall s':>7s}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, loss_overrides in parse_losses(args.losses):
            for seed in seeds:
                run_dir = Path(tmp) / f"{len(finals)}-{seed}"
                rows, wall = train(args.recipe, args.steps, 0, run_dir,
                                   [*loss_overrides, f"trainer.seed={seed}", *overrides], label)
                rewards = [r["reward/mean"] for r in rows]
                first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
                finals.setdefault(label, []).append(last)
                print(f"{label:44s} {seed:4d} {first:8.3f} {last:8.3f} {wall:7.1f}", flush=True)
    print(f"\n{'loss':44s} {'last10 mean':>11s} {'std over seeds':>14s}")
    for label, values in finals.items():
        spread = statistics.stdev(values) if len(values) > 1 else float("nan")
        print(f"{label:44s} {statistics.fmean(values):11.3f} {spread:14.3f}")


if __name__ == "__main__":
    main()
