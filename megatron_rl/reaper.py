"""``python -m megatron_rl.reaper PARENT PID:START ...``: wait for PARENT to die, then kill each
process (the same one: its start time must match, a reused pid is left alone) and everything
under it (``lifetime.reap_with_us``). Exits at once if PARENT is already gone."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from typing import List, Tuple

_PR_SET_PDEATHSIG = 1


def _kill_trees(targets: List[Tuple[int, float]]) -> None:
    import psutil

    procs = []
    for pid, started in targets:
        try:
            root = psutil.Process(pid)
            if abs(root.create_time() - started) < 1e-3:
                procs += [root, *root.children(recursive=True)]  # listed before the root dies
        except psutil.Error:
            pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def main(argv: List[str]) -> None:
    parent = int(argv[0])
    targets = [(int(pid), float(start)) for pid, start in (a.split(":") for a in argv[1:])]
    signal.signal(signal.SIGTERM, lambda *_: (_kill_trees(targets), sys.exit(0)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the job is the parent's to handle
    # SIGTERM (not SIGKILL) when the parent dies, so that the handler above runs.
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        _kill_trees(targets)
        return
    while True:
        signal.pause()


if __name__ == "__main__":
    main(sys.argv[1:])
