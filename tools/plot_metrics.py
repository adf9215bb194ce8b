"""Draw a run's curves from its metrics.jsonl: reward, response length, staleness, throughput.

    python tools/plot_metrics.py runs/tiny_cpu/<stamp> -o tiny_cpu.png
    python tools/plot_metrics.py runs/a runs/b -o compare.pdf --smooth 20      # runs side by side
    python tools/plot_metrics.py runs/a -o loss.svg --keys train/loss,train/entropy

The format follows the output's suffix (png, pdf, svg, ...). Needs matplotlib (the [plot] extra:
pip install 'megatron_rl[plot]'). A run still going can be drawn: a torn last line is skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# (title, y label, [(metrics.jsonl key, line label)]): the default panels.
PANELS: List[Tuple[str, str, List[Tuple[str, str]]]] = [
    ("reward", "reward/mean", [("reward/mean", "mean")]),
    ("response length", "tokens", [("response/length_mean", "mean"), ("response/length_max", "max")]),
    ("staleness", "policy versions behind", [("staleness/mean", "mean"), ("staleness/max", "max")]),
    ("throughput", "tokens/s", [("perf/generate_tokens_per_s", "generated"), ("perf/train_tokens_per_s", "trained")]),
]
PROG = "plot_metrics"


class PlotError(ValueError):
    """Input the tool cannot draw; one line naming it and the fix."""


def load_metrics(run_dir: Path) -> List[Dict[str, float]]:
    """The rows of ``run_dir/metrics.jsonl`` in step order (null, a non-finite value, as NaN)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl: give a run directory (trainer.run_dir, e.g. "
                        "runs/tiny_cpu/<stamp>) that has trained a step")
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a run killed (or still writing) mid-line
        rows.append({k: (math.nan if v is None else v) for k, v in row.items()})
    if not rows:
        raise PlotError(f"{path} has no step yet: draw it after the run's first step")
    return sorted(rows, key=lambda r: r["step"])


def moving_mean(values: Sequence[float], window: int) -> List[float]:
    """The mean of each value and the ``window - 1`` before it (NaNs left out)."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
        out.append(sum(seen) / len(seen) if seen else math.nan)
    return out


def run_label(run_dir: Path, runs: Sequence[Path]) -> str:
    """The shortest tail of the path that tells the runs apart (runs/tiny_cpu/<stamp> -> tiny_cpu/<stamp>)."""
    parts = run_dir.resolve().parts
    for depth in range(1, len(parts) + 1):
        tails = {r.resolve().parts[-depth:] for r in runs}
        if len(tails) == len(runs) and (depth >= 2 or len(runs) > 1):
            return "/".join(parts[-depth:])
    return str(run_dir)


def panels_for(keys: Optional[str]) -> List[Tuple[str, str, List[Tuple[str, str]]]]:
    if not keys:
        return PANELS
    return [(key, key, [(key, key)]) for key in keys.split(",") if key]


def pyplot():
    """matplotlib's pyplot drawing into files (no display needed); PlotError when not installed."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install 'megatron_rl[plot]' (or pip install matplotlib)") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: Sequence[Path], out: Path, smooth: Optional[int] = None, keys: Optional[str] = None) -> Path:
    """Draw ``runs`` into ``out``; returns ``out``. Raises PlotError for input it cannot draw."""
    plt = pyplot()
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise PlotError(f"-o {out}: matplotlib cannot write .{suffix or '<no suffix>'} files: end the name in "
                        + ", ".join(f".{f}" for f in sorted(formats)))
    fig = figure(runs, smooth, keys)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def figure(runs: Sequence[Path], smooth: Optional[int] = None, keys: Optional[str] = None):
    """The matplotlib Figure of ``runs``: a panel per entry of PANELS (or per key of ``keys``), a
    colour per run, the raw values faint under their moving mean."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    data = {run: load_metrics(run) for run in runs}
    panels = panels_for(keys)
    present = {k for rows in data.values() for r in rows for k in r}
    missing = [key for _, _, lines in panels for key, _ in lines if key not in present]
    if keys and missing:
        raise PlotError(f"--keys {','.join(missing)}: not in metrics.jsonl; its keys are "
                        + ", ".join(sorted(k for k in present if k != "step")))
    columns = 2 if len(panels) > 1 else 1
    rows_n = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(6.4 * columns, 3.6 * rows_n), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ylabel, lines) in zip(axes.flat, panels):
        for i, (run, rows) in enumerate(data.items()):
            steps = [r["step"] for r in rows]
            window = smooth or max(1, len(rows) // 50)
            for j, (key, label) in enumerate(lines):
                if key not in rows[0] and not any(key in r for r in rows):
                    continue
                values = [float(r.get(key, math.nan)) for r in rows]
                name = " ".join(p for p in (run_label(run, runs) if len(runs) > 1 else "", label) if p)
                style = "-" if j == 0 else "--"
                if window > 1:
                    ax.plot(steps, values, style, color=colors[i % len(colors)], alpha=0.25, linewidth=0.8)
                    values = moving_mean(values, window)
                ax.plot(steps, values, style, color=colors[i % len(colors)], linewidth=1.6, label=name)
        ax.set_title(title + (f" (mean over {smooth} steps)" if smooth and smooth > 1 else ""))
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(run_label(runs[0], runs) if len(runs) == 1 else f"{len(runs)} runs")
    fig.tight_layout()
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with a metrics.jsonl)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the file to write (its suffix: the format)")
    parser.add_argument("--smooth", type=int, default=None,
                        help="moving mean over this many steps (default: 1/50 of the run; 1: raw values only)")
    parser.add_argument("--keys", default=None,
                        help="comma-separated metrics.jsonl keys, one panel each, instead of the default four")
    args = parser.parse_args(argv)
    if args.smooth is not None and args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: give a number of steps >= 1")
    try:
        out = plot(args.runs, args.output, args.smooth, args.keys)
    except PlotError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
