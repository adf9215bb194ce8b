"""Tools under tools/."""

import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_plot_timeline_draws_every_span(tmp_path):
    spans = [{"name": "generate", "start": 0.0, "end": 1.0}, {"name": "train", "start": 0.5, "end": 2.0},
             {"name": "sync", "start": 2.0, "end": 2.1}, {"name": "generate", "start": 1.0, "end": 3.0}]
    (tmp_path / "timeline.jsonl").write_text("\n".join(json.dumps(s) for s in spans))
    result = subprocess.run([sys.executable, str(TOOLS / "plot_timeline.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    svg = (tmp_path / "timeline.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 4
    assert ">generate<" in svg and ">train<" in svg and ">sync<" in svg
