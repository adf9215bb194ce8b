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

logger = logging.getLogger(__name__)

STOP_FILE = ".stop_requested"
# The exit status of a trainer that stopped on request after writing its checkpoint.
STOPPED_EXIT = 3


class StopRequested(Exception):
    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"stopped on request after step {step}; checkpoint {checkpoint}; run the same "
                         "command again (same trainer.run_dir) to continue")
        self.step = step


_signalled = False


def _on_signal(signum, frame) -> None:
    global _signalled
    logger.warning("received %s: stopping after this step with a checkpoint", signal.Signals(signum).name)
    _signalled = True


def install_stop_handlers() -> None:
    """SIGUSR1 and SIGTERM ask for a stop (from the main thread; elsewhere only the file does)."""
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        try:
            signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread (e.g. a test driving the trainer): file only
            pass


def local_stop_requested() -> bool:
    """Whether this process received a stop signal."""
    return _signalled


class StopWatch:
    """Whether a stop was requested of this process: a signal, or the stop file. (In a torchrun
    world the driver asks every learner rank too, ``LearnerWorker.any_rank_asked``, so all of
    them stop after the same step.)"""

    def __init__(self, run_dir: Path):
        self.file = run_dir / STOP_FILE
        install_stop_handlers()

    def requested(self) -> bool:
        return local_stop_requested() or self.file.exists()
