"""A run's context: its directory and everything written there for a person (or a test) reading
the run afterwards -- the log, per-step metrics and trackers, the timeline, decoded samples, the
trained batches, GPU telemetry -- and the stop watch. The driver (``Trainer``), the eval command
and the benchmarks (through the entry points) open one; the driver only drives.

Opened in two parts: the directory, log, timeline, samples and stop watch before anything is
built (a config or component error is logged there); the per-step writers once the first step
is known (a resumed run drops the rows of steps after its checkpoint)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..config.schema import RootConfig
from ..stop import StopWatch, uninstall_stop_handlers
from .gpu import GpuTelemetry
from .metrics import MetricsWriter, Timeline, TrainedBatches
from .run_dir import make_run_dir, setup_logging
from .trackers import open_trackers

logger = logging.getLogger(__name__)


class RunContext:
    """The run directory ``cfg.trainer.run_dir`` (made if new) and its writers."""

    def __init__(self, cfg: RootConfig, log_name: str = "train.log"):
        self.cfg = cfg
        self.dir: Path = make_run_dir(cfg)
        setup_logging(self.dir / "logs" / log_name)
        self.timeline = Timeline(self.dir / "timeline.jsonl")
        self.samples = (self.dir / "samples.jsonl").open("a", buffering=1)
        self.stop_watch = StopWatch(self.dir)
        self.metrics: Optional[MetricsWriter] = None
        self.trained: Optional[TrainedBatches] = None
        self.gpu_telemetry: Optional[GpuTelemetry] = None

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"

    def open_step_writers(self, first_step: int) -> None:
        """Metrics (and the trackers of ``trainer.loggers``), trained batches and GPU telemetry
        from ``first_step`` on: rows and TensorBoard events of later steps (a run that died past
        its checkpoint) are dropped; W&B and MLflow continue the run's own run."""
        t = self.cfg.trainer
        trackers = open_trackers(t.loggers, self.dir, t.project, t.run_name, first_step=first_step)
        self.metrics = MetricsWriter(self.dir, first_step=first_step, trackers=trackers)
        # Per-step GPU utilisation, memory, power, clocks (telemetry/gpu.py); empty without a GPU.
        self.gpu_telemetry = GpuTelemetry(t.gpu_telemetry_interval_s).start()
        self.trained = TrainedBatches(self.dir, first_step=first_step)
        logger.info("run directory: %s", self.dir)

    def write_world(self, table: str, ranks: List[Dict[str, Any]]) -> None:
        """world.json: the placement plan and every rank's role, host and pid."""
        logger.info("torchrun world:\n%s", table)
        (self.dir / "world.json").write_text(json.dumps({"plan": table, "ranks": ranks}, indent=1))

    def close(self, finished: bool) -> None:
        """Flush and close every writer; ``finished``: the run ended as planned (trackers mark it)."""
        if self.metrics is not None:
            self.metrics.close(finished)
        if self.gpu_telemetry is not None:
            self.gpu_telemetry.close()
        if self.trained is not None:
            self.trained.close()
        self.timeline.close()
        self.samples.close()
        uninstall_stop_handlers()  # the run is over: a TERM from now on ends the process
