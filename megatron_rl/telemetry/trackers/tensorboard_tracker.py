"""TensorBoard events in the run directory's tb/ (``tensorboard --logdir runs/``)."""

from __future__ import annotations

import numpy as np

from . import Metrics, TrackedRun, Tracker


class TensorBoardTracker(Tracker):
    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run drops the events of steps from first_step on: the run before it died
        # past its checkpoint, and those steps are done again.
        self.writer = SummaryWriter(log_dir=str(run.run_dir / "tb"),
                                    purge_step=run.first_step if run.first_step > 1 else None)

    def log(self, step: int, metrics: Metrics) -> None:
        for key, value in metrics.items():
            if isinstance(value, list):
                if sum(value):
                    self.writer.add_histogram(key, np.repeat(np.arange(len(value)), value), step)
            else:
                self.writer.add_scalar(key, value, step)

    def close(self, finished: bool = True) -> None:
        self.writer.close()


def open_tracker(run: TrackedRun) -> TensorBoardTracker:
    return TensorBoardTracker(run)
