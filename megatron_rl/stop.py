"""Stop requests: a scheduler about to preempt the job (Slurm's --signal, a TERM) asks the trainer
to write a checkpoint at the end of the current step and exit with ``STOPPED_EXIT``; starting the
same command again resumes from that checkpoint.

A request is SIGUSR1 or SIGTERM to the trainer process, or the file ``STOP_FILE`` in the run
directory (what the sbatch script writes: a signal to the batch shell does not reliably reach
processes under srun and torchrun, a file on the shared filesystem does)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

logger = logging.getLogger(__name__)

STOP_FILE = ".stop_requested"
# The exit status of a trainer that stopped on request after writing its checkpoint.
STOPPED_EXIT = 3
# Where the driver writes its exit status (set by the sbatch script): torchrun turns any failed
# rank's status into 1, so STOPPED_EXIT reaches the batch shell only through this file.
EXIT_FILE_ENV = "MEGATRON_RL_EXIT_FILE"


def record_exit(status: int) -> int:
    """Write ``status`` to the file ``$MEGATRON_RL_EXIT_FILE`` names (the driver, rank 0, only)
    and return it."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        try:
            Path(path).write_text(f"{status}\n")
        except OSError as err:
            logger.warning("could not record the exit status in %s: %s", path, err)
    return status


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


def uninstall_stop_handlers() -> None:
    """The default actions again (a finished run has no step to stop after: TERM ends the process)."""
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        try:
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, signal.SIG_DFL)
        except ValueError:
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
