"""No process outlives its job: a child asks the kernel to kill it when its parent dies.

A trainer killed with SIGKILL runs no clean-up, so its children must not depend on one: Linux's
parent-death signal (``prctl(PR_SET_PDEATHSIG)``) delivers SIGKILL to the child the moment its
parent exits, however it exits. Elsewhere (no prctl) this is a no-op and children are still shut
down by the parent's normal exit paths. Used by torchrun's ranks, engine processes, and the
process Megatron's checkpoint writer starts (``checkpoint_writer_dies_with_us``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Have this process killed when ``parent_pid`` (its parent) exits; if the parent is already
    gone (it died between starting us and this call), exit now. Returns whether the signal is set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            return False
    except OSError as err:
        logger.warning("no parent-death signal (%s): this process may outlive a killed parent", err)
        return False
    if os.getppid() != parent_pid:  # the parent exited before the signal was armed
        os._exit(1)
    return True


_writer_manager = None
_writer_queue = None


def _checkpoint_writer_init(parent_pid: int) -> None:
    """The checkpoint writer's Manager: dies with the trainer, and ignores the stop and interrupt
    signals. On preemption (``scontrol requeue``) Slurm sends TERM to every process of the job
    step, this one too; the trainer answers TERM by writing its stop checkpoint, which needs this
    process alive until the save ends (killed, it fails the save with BrokenPipeError)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent_pid)


def _results_queue():
    """The writer's results queue, from a Manager of ours that is alive. The parent-death signal
    follows the thread that started the Manager: when that thread ends (the learner thread of a
    trainer that finished, in a process that goes on, e.g. a test), the Manager is killed with
    it, and the next save starts another one instead of failing on the dead one's queue."""
    global _writer_manager, _writer_queue
    process = getattr(_writer_manager, "_process", None)
    if _writer_queue is None or process is None or not process.is_alive():
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=_checkpoint_writer_init, initargs=(os.getpid(),))
        _writer_manager, _writer_queue = manager, manager.Queue()
    return _writer_queue


def checkpoint_writer_dies_with_us() -> None:
    """megatron-core's checkpoint writer collects results through a multiprocessing Manager,
    a server process it starts on first save and that watches nothing: after a SIGKILL of this
    process it would live on, orphaned, and a TERM meant for the trainer (preemption) would kill
    it mid-save. Have Megatron take its queue from a Manager of ours instead (``_results_queue``:
    a parent-death signal, TERM ignored, started again if it died). Idempotent."""
    forks_die_with_us()
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    filesystem_async._get_write_results_queue = _results_queue


_fork_hook = False


def forks_die_with_us() -> None:
    """Give every child this process forks from now on the parent-death signal (idempotent).
    megatron-core's checkpoint writer forks its worker processes (multiprocessing's fork context,
    no initializer of ours): a rank SIGKILLed during a save left such a worker alive, orphaned,
    in the rank's session, out of reach of a kill of the launcher's process group. The signal
    follows the forking thread, which waits for the writers within the save."""
    global _fork_hook
    if _fork_hook or not hasattr(os, "register_at_fork"):
        return
    # The parent's pid is taken before the fork: read in the child, a parent killed before the
    # child armed its signal would already read as the child's new parent (init or a subreaper).
    parent = {"pid": os.getpid()}
    os.register_at_fork(before=lambda: parent.update(pid=os.getpid()),
                        after_in_child=lambda: die_with_parent(parent["pid"]))
    _fork_hook = True


def reap_with_us(pids) -> None:
    """Processes that we did not start ourselves (vLLM's engine core, which vLLM spawns) cannot be
    given a parent-death signal. A small reaper process is: when this process dies, however it
    dies, the reaper kills ``pids`` and everything under them, then exits. Call it from the
    main thread (the kernel's parent-death signal follows the thread that made the child)."""
    import subprocess

    import psutil

    targets = []
    for pid in pids:
        try:
            targets.append(f"{pid}:{psutil.Process(pid).create_time()}")
        except psutil.Error:
            pass
    if not targets or not sys.platform.startswith("linux"):
        return
    subprocess.Popen([sys.executable, "-m", "megatron_rl.reaper", str(os.getpid()), *targets],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     # Out of the job's process group: a signal meant for the job's processes
                     # (Ctrl-C, a group SIGTERM) must not make it kill vLLM before they stop.
                     start_new_session=True, close_fds=True)


def available_cores() -> int:
    """Cores this process may use: the job's allocation on this node (``MEGATRON_RL_CPUS``, set by
    the sbatch script), else the CPU affinity (a container's or taskset's), never the whole node's."""
    allocated = os.environ.get("MEGATRON_RL_CPUS", "")
    if allocated.isdigit() and int(allocated) > 0:
        return int(allocated)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def skip_final_gc() -> None:
    """Let this process exit without collecting garbage over its whole heap.

    After the atexit handlers, CPython's finalization runs full garbage collections over every
    object still alive; a process that imported torch and megatron-core and built a model holds
    millions, and those passes took seconds of CPU per rank (every rank of a finished torchrun
    world sat in ``gc_collect_main`` for ~8 s on the 2-core CI box, the launcher waiting on them).
    ``gc.freeze()`` as the last atexit handler moves them out of the collector's reach; the
    memory goes back with the process anyway. Everything that holds data is closed before then
    (the trainer closes its writers; logging's own atexit handler flushes the log). Call it at the
    start of an entry point, before anything else registers an atexit handler, so that it runs last.
    """
    import atexit
    import gc

    global _final_gc_skipped
    if not _final_gc_skipped:
        atexit.register(gc.freeze)
        _final_gc_skipped = True


_final_gc_skipped = False
