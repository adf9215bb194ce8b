"""Experiment trackers: where each step's scalars go besides metrics.jsonl (``trainer.loggers``).

One file per tracker, each with ``open_tracker(run) -> Tracker``; only the driver (rank 0 of a
world, the one process otherwise) opens them, through ``MetricsWriter``. A tracker's run id is
kept in the run directory (``trackers.json``), so a resumed run continues the same run there."""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ...errors import ConfigError, UserError, nearest

# name -> (this package's module, the package it imports, how to install that package)
TRACKERS: Dict[str, Tuple[str, str, str]] = {
    "tensorboard": ("tensorboard_tracker", "tensorboard", "pip install tensorboard"),
    "wandb": ("wandb_tracker", "wandb", "pip install 'megatron_rl[wandb]'"),
    "mlflow": ("mlflow_tracker", "mlflow", "pip install 'megatron_rl[mlflow]'"),
}
STATE_FILE = "trackers.json"

Metrics = Mapping[str, Union[float, List[int]]]


class TrackerError(UserError):
    """A tracker that cannot start its run (not logged in, a store it cannot open)."""


class Tracker(ABC):
    """One tracker's run. ``state`` is what a resumed run needs to continue it (its id)."""

    state: Dict[str, str] = {}

    @abstractmethod
    def log(self, step: int, metrics: Metrics) -> None:
        """The step's metrics: scalars, and histograms as lists of counts per integer bucket
        (a tracker without histograms skips them)."""

    @abstractmethod
    def close(self, finished: bool = True) -> None:
        """End the run; ``finished`` False marks it failed (or stopped) where the tracker can."""


@dataclass
class TrackedRun:
    """What a tracker is told about the run it logs."""
    run_dir: Path
    name: str
    project: str
    config: Dict[str, Any]        # the run's config.yaml
    first_step: int = 1           # > 1: a resumed run, from this step on
    saved: Dict[str, str] = field(default_factory=dict)  # this tracker's state from an earlier start


def scalars(metrics: Metrics) -> Dict[str, float]:
    """The metrics that are numbers (histograms left out)."""
    return {k: float(v) for k, v in metrics.items() if not isinstance(v, (list, tuple))}


def flatten(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"model": {"hidden_size": 64}}`` -> ``{"model.hidden_size": 64}``: the names users type."""
    out: Dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def tracker_problem(name: str) -> Optional[str]:
    """Why ``trainer.loggers`` cannot hold ``name`` (unknown, or its package missing); None if it can."""
    if name not in TRACKERS:
        guess = nearest(name, TRACKERS)
        return (f"trainer.loggers has {name!r}, which is not a tracker: " + (f"did you mean {guess}? " if guess else "")
                + "choose from " + ", ".join(TRACKERS) + ", e.g. trainer.loggers=[tensorboard,wandb]")
    _, package, install = TRACKERS[name]
    if importlib.util.find_spec(package) is None:
        return (f"trainer.loggers has {name}, but the {package} package is not installed: {install} "
                "(or leave it out of trainer.loggers)")
    return None


def default_run_name(run_dir: Path, recipe: str) -> str:
    return f"{recipe}/{run_dir.name}"


def open_trackers(names: Sequence[str], run_dir: Path, project: str, run_name: Optional[str],
                  first_step: int = 1) -> List[Tracker]:
    """The trackers ``names`` asks for, each with its run started (or continued: the ids in the run
    directory's trackers.json). Raises TrackerError for one that cannot start; those already
    started are closed first."""
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    name = run_name or default_run_name(run_dir, config.get("trainer", {}).get("recipe", "custom"))
    path = run_dir / STATE_FILE
    state: Dict[str, Dict[str, str]] = json.loads(path.read_text()) if path.is_file() else {}
    opened: List[Tracker] = []
    try:
        for tracker_name in dict.fromkeys(names):
            problem = tracker_problem(tracker_name)
            if problem:
                raise TrackerError(problem)
            module = importlib.import_module(f"{__name__}.{TRACKERS[tracker_name][0]}")
            tracker = module.open_tracker(TrackedRun(run_dir, name, project, config, first_step,
                                                     state.get(tracker_name, {})))
            opened.append(tracker)
            if tracker.state:
                state[tracker_name] = {**tracker.state, "started": state.get(tracker_name, {}).get(
                    "started", time.strftime("%Y-%m-%dT%H:%M:%S"))}
                path.write_text(json.dumps(state, indent=1) + "\n")  # at once: a crash later keeps the id
    except BaseException:
        for tracker in opened:
            tracker.close(finished=False)
        raise
    return opened


def check_trackers(names: Sequence[str]) -> None:
    """trainer.loggers: a tracker that is unknown, or not installed, is an error before anything runs."""
    for name in names:
        problem = tracker_problem(name)
        if problem:
            raise ConfigError(problem)
