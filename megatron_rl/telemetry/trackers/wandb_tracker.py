"""Weights & Biases: one W&B run per run directory, its files in the run directory's wandb/.
``WANDB_MODE=offline`` keeps it on disk (``wandb sync <run_dir>/wandb/offline-run-*`` uploads it
later); ``WANDB_ENTITY``, ``WANDB_BASE_URL`` and W&B's other variables apply as usual."""

from __future__ import annotations

from . import Metrics, TrackedRun, Tracker, TrackerError, scalars
from ...errors import one_line

# The x axis of every chart: the training step (W&B's own step counter cannot go back, and a
# resumed run does again the steps after its checkpoint).
STEP_KEY = "step"


class WandbTracker(Tracker):
    def __init__(self, handle):
        self.handle = handle
        self.state = {"id": handle.id, "project": handle.project}

    def log(self, step: int, metrics: Metrics) -> None:
        self.handle.log({STEP_KEY: step, **scalars(metrics)})

    def close(self, finished: bool = True) -> None:
        self.handle.finish(exit_code=0 if finished else 1)


def open_tracker(run: TrackedRun) -> WandbTracker:
    import wandb

    try:
        handle = wandb.init(project=run.saved.get("project", run.project), name=run.name,
                            id=run.saved.get("id"), resume="allow", dir=str(run.run_dir),
                            # Our log is logs/train.log; W&B's console capture would wrap stdout.
                            settings=wandb.Settings(console="off"))
    except Exception as err:  # W&B raises many kinds (UsageError, CommError, ...) for one reason: no run
        raise TrackerError(f"trainer.loggers has wandb, but W&B could not start a run ({one_line(err)}): log in "
                           "with `wandb login`, or set WANDB_MODE=offline to keep the run on disk") from None
    # The resolved config, as config.yaml has it; a resumed run may change values (total_steps).
    handle.config.update(run.config, allow_val_change=True)
    handle.define_metric(STEP_KEY)
    handle.define_metric("*", step_metric=STEP_KEY)
    return WandbTracker(handle)
