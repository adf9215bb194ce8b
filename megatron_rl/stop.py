"""Stop requests: a scheduler about to preempt the job (Slurm's --signal, a TERM) asks the trainer
to write a checkpoint at the end of the current step and exit with ``STOPPED_EXIT``; starting the
same command again resumes from that checkpoint.

A request is SIGUSR1 or SIGTERM to the trainer process, or the file ``STOP_FILE`` in the run
directory (what the sbatch script writes: a signal to the batch shell does not reliably reach
processes under srun and torchrun, a file on the shared filesystem does)."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

STOP_FILE = ".stop_requested"
# The exit status of a trainer that stopped on request after writing its checkpoint.
STOPPED_EXIT = 3


class StopRequested(Exception):
    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"stopped on request after step {step}; checkpoint {checkpoint}; run the same "
                         "command again (same trainer.run_dir) to continue")
        self.step = step


class StopWatch:
    """Whether a stop was requested; every rank of a torchrun world gets the same answer (one
    all-reduce), so all of them stop after the same step."""

    def __init__(self, run_dir: Path):
        self.file = run_dir / STOP_FILE
        self._signalled = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            try:
                signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. a test driving the trainer): file only
                pass

    def _on_signal(self, signum, frame) -> None:
        logger.warning("received %s: stopping after this step with a checkpoint", signal.Signals(signum).name)
        self._signalled = True

    def requested(self) -> bool:
        asked = self._signalled or self.file.exists()
        if dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            flag = torch.tensor([1.0 if asked else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            asked = bool(flag.item())
        return asked
