"""Step metrics to TensorBoard and metrics.jsonl (the same scalars), plus the timeline spans."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Union

import numpy as np


class MetricsWriter:
    """``first_step`` > 1 continues a resumed run: rows and events of steps from ``first_step`` on,
    written by the run before it died past its checkpoint, are dropped (they are done again)."""

    def __init__(self, run_dir: Path, first_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter

        path = run_dir / "metrics.jsonl"
        self._kept: List[Dict] = []
        if first_step > 1 and path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self._kept = [r for r in rows if r["step"] < first_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self._kept))
            os.replace(tmp, path)
        self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=first_step if first_step > 1 else None)
        self.jsonl = path.open("a", buffering=1)

    def history(self) -> List[Dict]:
        """The rows of the steps before ``first_step`` (empty for a fresh run), without their step key."""
        return [{k: v for k, v in r.items() if k != "step"} for r in self._kept]

    def write(self, step: int, metrics: Dict[str, Union[float, List[int]]]) -> None:
        """Scalars, plus histograms given as a list of counts per integer bucket
        (e.g. ``staleness/histogram``: how many samples were 0, 1, 2, ... versions old)."""
        for key, value in metrics.items():
            if isinstance(value, list):
                if sum(value):
                    self.tb.add_histogram(key, np.repeat(np.arange(len(value)), value), step)
            else:
                self.tb.add_scalar(key, value, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        self.tb.close()
        self.jsonl.close()


class Timeline:
    """Spans (generate / reward / train / sync) per rank over wall time, one JSON line each."""

    def __init__(self, path: Path, rank: int = 0):
        self.file = path.open("a", buffering=1)
        self.rank = rank
        self.pid = os.getpid()

    @contextmanager
    def span(self, name: str, **attrs) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            end = time.time()
            self.file.write(json.dumps({"name": name, "rank": self.rank, "pid": self.pid,
                                        "start": start, "end": end, **attrs}) + "\n")

    def close(self) -> None:
        self.file.close()
