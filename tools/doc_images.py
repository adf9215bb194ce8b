"""Remake the pictures in docs/images/ from a real tiny_cpu run.

    python tools/doc_images.py                       # run tiny_cpu (about 5 min on 2 cores), then draw
    python tools/doc_images.py --run-dir runs/tiny_cpu/<stamp>   # draw from a finished run
    python tools/doc_images.py --arithmetic runs/arithmetic_demo/<stamp>   # the arithmetic demo's curves

Writes docs/images/timeline.svg (the overlap timeline, drawn by tools/plot_timeline.py, of a few
steps in the middle of the run) and docs/images/reward.svg (reward per step from metrics.jsonl);
with ``--arithmetic``, docs/images/arithmetic_demo.svg from a finished ``tools/arithmetic_demo.py``
run instead (its SFT loss and RL reward per step, and held-out pass@1 / pass@k per stage).
SVG, so no plotting library is needed and the files stay small.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plot_timeline import load_spans, render  # noqa: E402  (a sibling tool)


def run_tiny_cpu(run_dir: Path, overrides: Sequence[str]) -> None:
    cmd = [sys.executable, "-m", "megatron_rl.main", "recipe=tiny_cpu", f"trainer.run_dir={run_dir}",
           "trainer.progress=false", *overrides]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def window(spans: List[Dict], steps: int) -> List[Dict]:
    """The spans overlapping ``steps`` consecutive training steps in the middle of the run, clipped
    to them (a window in steps, not seconds, so a slow machine draws the same picture)."""
    trains = sorted((s for s in spans if s["name"] == "train"), key=lambda s: s["start"])
    first = trains[max(0, len(trains) // 2 - steps // 2)]
    last = trains[min(len(trains) - 1, trains.index(first) + steps - 1)]
    lo, hi = first["start"], last["end"]
    return [{**s, "start": max(s["start"], lo), "end": min(s["end"], hi)}
            for s in spans if s["end"] > lo and s["start"] < hi]


def moving_mean(values: List[float], smooth: int) -> List[float]:
    """Each value's mean with up to ``smooth`` - 1 values before it."""
    return [sum(values[max(0, i - smooth + 1):i + 1]) / len(values[max(0, i - smooth + 1):i + 1])
            for i in range(len(values))]


def reward_svg(steps: List[int], rewards: List[float], width: int = 720, height: int = 300, smooth: int = 10) -> str:
    """Reward per step (light) and its moving mean over ``smooth`` steps (dark), axes labelled."""
    left, right, top, bottom = 50, 15, 15, 40
    x_max = max(steps)
    y_lo, y_hi = min(0.0, min(rewards)), max(1.0, max(rewards))

    def xy(step: float, value: float) -> str:
        x = left + (step - 1) / max(x_max - 1, 1) * (width - left - right)
        y = top + (y_hi - value) / (y_hi - y_lo) * (height - top - bottom)
        return f"{x:.1f},{y:.1f}"

    mean = moving_mean(rewards, smooth)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>']
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = xy(1, tick).split(",")[1]
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{float(y) + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for step in range(0, x_max + 1, max(100, (x_max // 700) * 100)):
        x = xy(max(step, 1), y_lo).split(",")[0]
        out.append(f'<text x="{x}" y="{height - bottom + 16}" text-anchor="middle">{step}</text>')
    out.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 6}" text-anchor="middle">step</text>')
    out.append(f'<polyline fill="none" stroke="#9ecae1" stroke-width="1" points="{" ".join(xy(s, r) for s, r in zip(steps, rewards))}"/>')
    out.append(f'<polyline fill="none" stroke="#08519c" stroke-width="2" points="{" ".join(xy(s, m) for s, m in zip(steps, mean))}"/>')
    out.append(f'<text x="{left + 8}" y="{top + 14}">reward/mean per step, and its mean over {smooth} steps</text>')
    out.append("</svg>")
    return "\n".join(out)


def _panel(x0: float, width: float, height: float, steps: List[int], values: List[float], title: str,
           smooth: int, y_range: tuple) -> List[str]:
    """One curve panel at x offset ``x0``: values per step (light), their moving mean (dark)."""
    left, right, top, bottom = 50, 15, 30, 40
    y_lo, y_hi = y_range
    x_max = max(max(steps), 2)

    def xy(step: float, value: float) -> str:
        x = x0 + left + (step - 1) / (x_max - 1) * (width - left - right)
        y = top + (y_hi - value) / (y_hi - y_lo) * (height - top - bottom)
        return f"{x:.1f},{y:.1f}"

    mean = moving_mean(values, smooth)
    out = []
    for i in range(5):
        tick = y_lo + (y_hi - y_lo) * i / 4
        y = xy(1, tick).split(",")[1]
        out.append(f'<line x1="{x0 + left}" x2="{x0 + width - right}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 + left - 6}" y="{float(y) + 4:.1f}" text-anchor="end">{tick:.3g}</text>')
    for i in range(5):
        step = 1 + round((x_max - 1) * i / 4)
        x = xy(step, y_lo).split(",")[0]
        out.append(f'<text x="{x}" y="{height - bottom + 16}" text-anchor="middle">{step}</text>')
    out.append(f'<text x="{x0 + (left + width - right) / 2:.0f}" y="{height - 8}" text-anchor="middle">step</text>')
    out.append(f'<text x="{x0 + left}" y="{top - 10}">{title}</text>')
    out.append(f'<polyline fill="none" stroke="#9ecae1" stroke-width="1" '
               f'points="{" ".join(xy(s, v) for s, v in zip(steps, values))}"/>')
    out.append(f'<polyline fill="none" stroke="#08519c" stroke-width="2" '
               f'points="{" ".join(xy(s, m) for s, m in zip(steps, mean))}"/>')
    return out


def arithmetic_svg(report: Dict, sft_rows: List[Dict], rl_rows: List[Dict], width: int = 900,
                   height: int = 320) -> str:
    """The arithmetic demo: SFT's loss per step (left), RL's reward per step (right), each with its
    moving mean, and a caption of held-out pass@1 / pass@k before SFT, after SFT and after RL."""
    k = f"pass@{report['k']}"
    caption = "; ".join(f"{name}: pass@1 {stage['pass@1']:.3f}, {k} {stage[k]:.3f}"
                        for name, stage in report["stages"].items())
    losses = [r["train/loss"] for r in sft_rows]
    rewards = [r["reward/mean"] for r in rl_rows]
    half = width / 2
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 24}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{width}" height="{height + 24}" fill="white"/>']
    out += _panel(0, half, height, [r["step"] for r in sft_rows], losses, "SFT: train/loss per step",
                  max(1, len(losses) // 50), (0.0, max(losses)))
    out += _panel(half, half, height, [r["step"] for r in rl_rows], rewards, "RL (GRPO): reward/mean per step",
                  max(1, len(rewards) // 20), (0.0, 1.0))
    out.append(f'<text x="{width / 2:.0f}" y="{height + 16}" text-anchor="middle">held-out {caption}</text>')
    out.append("</svg>")
    return "\n".join(out)


def draw_arithmetic(demo_dir: Path) -> Path:
    """docs/images/arithmetic_demo.svg from a finished demo directory; its path."""
    rows = lambda run: [json.loads(line) for line in (demo_dir / run / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                        if line.strip()]
    report = json.loads((demo_dir / "arithmetic_demo.json").read_text())
    IMAGES.mkdir(parents=True, exist_ok=True)
    out = IMAGES / "arithmetic_demo.svg"
    out.write_text(arithmetic_svg(report, rows("sft"), rows("rl")))
    return out


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, help="a finished tiny_cpu run directory (default: run one)")
    parser.add_argument("--steps", type=int, default=6, help="training steps the timeline shows")
    parser.add_argument("--arithmetic", type=Path, default=None,
                        help="a finished tools/arithmetic_demo.py directory: draw its curves only")
    parser.add_argument("overrides", nargs="*", help="config overrides for the tiny_cpu run")
    args = parser.parse_args(argv or None)
    if args.arithmetic is not None:
        out = draw_arithmetic(args.arithmetic)
        print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size / 1024:.0f} KB)")
        return 0
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix="doc_images_")) / "run"
        run_tiny_cpu(run_dir, args.overrides)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    IMAGES.mkdir(parents=True, exist_ok=True)
    (IMAGES / "reward.svg").write_text(reward_svg([r["step"] for r in rows], [r["reward/mean"] for r in rows]))
    timeline = render(window(load_spans(run_dir), args.steps), width=900)
    # An opaque background, so the labels read on a dark page too.
    head, _, rest = timeline.partition(">")
    (IMAGES / "timeline.svg").write_text(f'{head}>\n<rect width="100%" height="100%" fill="white"/>{rest}')
    for name in ("timeline.svg", "reward.svg"):
        print(f"wrote docs/images/{name} ({(IMAGES / name).stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
