"""Draw a run's overlap timeline (timeline.jsonl) as an SVG: one lane per span kind, time on x.

    python tools/plot_timeline.py runs/tiny_cpu/<stamp> [--out timeline.svg] [--last-seconds 20]

Needs nothing beyond the standard library; open the SVG in any browser.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

LANES = ["generate", "reward", "train", "sync", "checkpoint"]
COLOURS = {"generate": "#4e79a7", "reward": "#f28e2b", "train": "#59a14f", "sync": "#e15759",
           "checkpoint": "#9c755f"}


class TimelineError(ValueError):
    """No timeline to draw; the message says where it was looked for and what to pass."""


def load_spans(run_dir: Path) -> List[Dict]:
    path = run_dir / "timeline.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise TimelineError(f"no timeline at {path}: pass a run directory (trainer.run_dir) that holds "
                            "timeline.jsonl, or the timeline.jsonl file itself")
    spans = []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            spans.append(json.loads(line))
        except ValueError:
            raise TimelineError(f"{path}:{lineno}: not a JSON span; delete that line (a run killed "
                                "mid-write leaves a torn last line)") from None
    if not spans:
        raise TimelineError(f"{path} has no spans yet: plot it once the run has made a step")
    return spans


def lane_of(span: Dict) -> str:
    """The driver's spans by name; another rank's (a torchrun world) in lanes of their own."""
    rank = span.get("rank", 0)
    return span["name"] if not rank else f"{span['name']} r{rank}"


def render(spans: List[Dict], width: int = 1200, lane_height: int = 28) -> str:
    if not spans:
        raise ValueError("timeline has no spans")
    t0 = min(s["start"] for s in spans)
    t1 = max(s["end"] for s in spans)
    scale = (width - 110) / max(t1 - t0, 1e-9)
    names = {lane_of(s) for s in spans}
    lanes = [lane for lane in LANES if lane in names]
    lanes += sorted(names - set(lanes), key=lambda lane: (lane.split(" r")[-1], lane))
    height = lane_height * len(lanes) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">']
    for i, lane in enumerate(lanes):
        y = 10 + i * lane_height
        out.append(f'<text x="4" y="{y + lane_height * 0.65:.1f}">{lane}</text>')
        for s in (s for s in spans if lane_of(s) == lane):
            x = 100 + (s["start"] - t0) * scale
            w = max((s["end"] - s["start"]) * scale, 0.5)
            out.append(f'<rect x="{x:.2f}" y="{y + 3}" width="{w:.2f}" height="{lane_height - 6}" '
                       f'fill="{COLOURS.get(lane.split(" r")[0], "#76b7b2")}" fill-opacity="0.55"/>')
    axis_y = 10 + len(lanes) * lane_height + 15
    out.append(f'<text x="100" y="{axis_y}">0 s</text>')
    out.append(f'<text x="{width - 60}" y="{axis_y}">{t1 - t0:.1f} s</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory or a timeline.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="SVG path (default <run_dir>/timeline.svg)")
    parser.add_argument("--last-seconds", type=float, default=0.0, help="draw only the last N seconds")
    args = parser.parse_args()
    try:
        spans = load_spans(args.run_dir)
    except TimelineError as err:
        print(f"plot_timeline: error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.last_seconds > 0:
        end = max(s["end"] for s in spans)
        spans = [s for s in spans if s["end"] >= end - args.last_seconds]
    out = args.out or (args.run_dir if args.run_dir.is_dir() else args.run_dir.parent) / "timeline.svg"
    out.write_text(render(spans))
    print(out)


if __name__ == "__main__":
    main()
