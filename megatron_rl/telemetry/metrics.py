"""Step metrics to metrics.jsonl and the experiment trackers (the same scalars), plus the timeline spans."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from ..errors import one_line

if TYPE_CHECKING:
    from .trackers import Tracker

logger = logging.getLogger(__name__)


def json_line(row: Dict) -> str:
    """One strict-JSON line: a non-finite number (NaN, inf) is written as null, which every JSON
    reader accepts (Python's json would write a bare NaN, which none but Python's accepts)."""
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    return json.dumps(clean(row), allow_nan=False) + "\n"


def keep_jsonl_rows(path: Path, keep: Callable[[Dict], bool]) -> List[Dict]:
    """Drop the rows of a JSON-lines file that ``keep`` rejects, in place (the same file: writers
    that hold it open for appending keep writing to it), and return the kept rows. A torn last
    line (a run killed mid-write) is dropped too."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    kept = [r for r in rows if keep(r)]
    with path.open("r+") as fh:
        fh.write("".join(json_line(r) for r in kept))
        fh.truncate()
    return kept


class MetricsWriter:
    """metrics.jsonl (always: the run's own record, read on resume and by tools/plot_metrics.py)
    and the experiment trackers (telemetry/trackers: TensorBoard by default). ``first_step`` > 1
    continues a resumed run: rows of steps from ``first_step`` on, written by the run before it
    died past its checkpoint, are dropped (they are done again)."""

    def __init__(self, run_dir: Path, first_step: int = 1, trackers: Optional[Sequence["Tracker"]] = None):
        path = run_dir / "metrics.jsonl"
        self._kept: List[Dict] = []
        if first_step > 1:
            self._kept = keep_jsonl_rows(path, lambda r: r["step"] < first_step)
        if trackers is None:
            from .trackers import TrackedRun
            from .trackers.tensorboard_tracker import open_tracker

            trackers = [open_tracker(TrackedRun(run_dir, "", "", {}, first_step))]
        self.trackers = list(trackers)
        self._failing: set = set()
        self.jsonl = path.open("a", buffering=1)

    def history(self) -> List[Dict]:
        """The rows of the steps before ``first_step`` (empty for a fresh run), without their step key."""
        return [{k: v for k, v in r.items() if k != "step"} for r in self._kept]

    def write(self, step: int, metrics: Dict[str, Union[float, List[int]]]) -> None:
        """Scalars, plus histograms given as a list of counts per integer bucket
        (e.g. ``staleness/histogram``: how many samples were 0, 1, 2, ... versions old)."""
        self.jsonl.write(json_line({"step": step, **metrics}))
        for tracker in self.trackers:
            try:
                tracker.log(step, metrics)
            except Exception as err:  # a tracker's server away for a while must not end a long run
                if type(tracker).__name__ not in self._failing:
                    self._failing.add(type(tracker).__name__)
                    logger.warning("step %d: %s could not log (%s); metrics.jsonl has every step, and further "
                                   "failures of this tracker are not reported", step, type(tracker).__name__,
                                   one_line(err))

    def close(self, finished: bool = True) -> None:
        """``finished`` False: the run failed or stopped early (trackers that can, say so)."""
        for tracker in self.trackers:
            try:
                tracker.close(finished)
            except Exception as err:
                logger.warning("%s could not close its run (%s)", type(tracker).__name__, one_line(err))
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
            self.file.write(json_line({"name": name, "rank": self.rank, "pid": self.pid,
                                       "start": start, "end": end, **attrs}))

    def close(self) -> None:
        self.file.close()


def forget_spans_after(path: Path, saved_at: float, step: int, version: int) -> int:
    """On resume from the checkpoint of ``step`` (policy ``version``, written at ``saved_at``):
    drop the spans of the work the dead run did after it, which the resumed run does again.
    Returns how many were dropped."""
    before = sum(1 for _ in path.open()) if path.exists() else 0
    kept = keep_jsonl_rows(path, lambda s: s.get("end", 0) <= saved_at and s.get("step", step) <= step
                           and s.get("version", version) <= version)
    return before - len(kept)


def run_lengths(values: Sequence[int]) -> List[List[int]]:
    """``[[value, count], ...]`` of consecutive equal values: a sample's per-token policy
    versions in a few pairs (a version changes only at a weight sync)."""
    values = np.asarray(values)
    if values.size == 0:
        return []
    if (values == values[0]).all():  # the common case: one version made every token
        return [[int(values[0]), int(values.size)]]
    starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    counts = np.diff(np.concatenate([starts, [values.size]]))
    return [[int(v), int(c)] for v, c in zip(values[starts], counts)]


class TrainedBatches:
    """``trained.jsonl``: per step, the policy version trained, the groups it trained (admission
    index, prompt uid) and every sample's token versions (run-length pairs), so the staleness
    bound can be audited from the run directory alone: a step that trains policy version ``v``
    under ``scheduler.max_staleness`` = η may hold no token of a version below ``v - η``."""

    FILE = "trained.jsonl"

    def __init__(self, run_dir: Path, first_step: int = 1):
        path = run_dir / self.FILE
        keep_jsonl_rows(path, lambda r: r["step"] < first_step)
        self.file = path.open("a", buffering=1)

    def write(self, step: int, version: int, groups) -> None:
        """``groups``: the step's FinishedGroups."""
        # Integers and ids only (no float to clean, unlike json_line's rows): one json.dumps per step.
        self.file.write(json.dumps({
            "step": step, "policy_version": version,
            "groups": [{"index": g.ticket.index, "uid": g.ticket.prompt.uid, "admitted_version": g.ticket.version,
                        "token_versions": [run_lengths(t.versions) for t in g.trajectories]} for g in groups]}) + "\n")

    def close(self) -> None:
        self.file.close()
