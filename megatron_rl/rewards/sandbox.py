"""Run untrusted Python (model-written programs, tool calls) in a contained child process.

Each run gets a fresh private directory (its working directory, ``HOME`` and ``TMPDIR``; removed
afterwards) and these limits (``SandboxLimits``): wall time, CPU time, address space, process
count, output size and file size. How much else is walled off depends on what the machine offers,
chosen once per process and logged (``isolation_mode()``):

- ``bubblewrap`` (Debian's ``bwrap``): no network, its own PID/IPC/UTS namespaces, a root file
  system that holds only the interpreter and system libraries, read-only, plus the private
  directory as the one writable place; nothing else of the host is visible.
- ``namespaces+rlimits`` (util-linux ``unshare``): no network, its own PID, mount, IPC and UTS
  namespaces, the rlimits; the host's files stay visible (as an unprivileged user when the
  trainer is root, so they are read-only to the program).
- ``rlimits``: resource limits and a process group only; network and files are not walled off.

When the trainer runs as root every run also gets a user id of its own, so the process-count limit
(counted per user by the kernel) counts only that run's processes. Programs see the standard
library only (``python -I``), never the trainer's packages.

Verdicts (``SandboxResult.status``): ``ok`` (exit 0), ``timeout`` (wall or CPU time), ``memory``
(an allocation failed at the address-space limit), ``crash`` (any other non-zero exit or signal).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional

logger = logging.getLogger(__name__)

# Forces an isolation mode (bubblewrap | namespaces+rlimits | rlimits) instead of the best one
# found; a forced mode that does not work here is an error at the first run.
MODE_ENV = "MEGATRON_RL_SANDBOX"
# Parent directory of the runs' private directories (default: the system temp dir).
DIR_ENV = "MEGATRON_RL_SANDBOX_DIR"
DIR_PREFIX = "megatron_rl_sandbox_"
MODES = ("bubblewrap", "namespaces+rlimits", "rlimits")
# Exit status the launcher uses for a MemoryError at the address-space limit.
MEMORY_EXIT = 86
# Where the private directory appears inside bubblewrap.
INSIDE_DIR = "/sandbox"
# Where an interpreter installed outside /usr appears inside bubblewrap.
INSIDE_PYTHON = "/python"


@dataclass
class SandboxLimits:
    # Seconds from start until the whole process tree is killed (verdict timeout).
    wall_s: float = 5.0
    # CPU seconds of the program's main process (SIGXCPU, then SIGKILL one second later).
    cpu_s: float = 5.0
    # Address-space limit of each process, in MiB (an allocation beyond it fails: verdict memory).
    memory_mb: int = 512
    # Processes and threads the program may run at once (fork bombs stop here).
    max_processes: int = 32
    # Bytes kept of stdout and of stderr each; the rest is read and dropped.
    max_output_bytes: int = 65536
    # Largest file the program may write, in MiB (fills of the private directory stop here).
    max_file_mb: int = 64


@dataclass
class SandboxResult:
    # ok | timeout | memory | crash (crash = non-zero exit or a signal)
    status: str
    # The program's exit status, -N for death by signal N; None when the sandbox killed it.
    exit_code: Optional[int]
    stdout: str
    stderr: str
    wall_s: float


# Runs inside the sandbox before the program: set the limits, give up root (to a user id of this
# run), then run the program as __main__. When it is PID 1 of a new PID namespace (unshare), it
# forks first and stays as the reaper: signals a program sends to PID 1 itself are ignored by the
# kernel, and PID 1 must collect orphans.
_LAUNCHER = r"""
import os, resource as R, runpy, sys
cpu, mem, nproc, fsize, uid = map(int, sys.argv[1:6]); path = sys.argv[6]
if os.getpid() == 1:
    child = os.fork()
    if child:
        while True:
            pid, status = os.wait()
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                os._exit(128 - code if code < 0 else code)
R.setrlimit(R.RLIMIT_CORE, (0, 0))
R.setrlimit(R.RLIMIT_CPU, (cpu, cpu + 1))
R.setrlimit(R.RLIMIT_AS, (mem, mem))
R.setrlimit(R.RLIMIT_FSIZE, (fsize, fsize))
R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
if uid >= 0:
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
sys.argv = [path]
del cpu, mem, nproc, fsize, uid
try:
    runpy.run_path(path, run_name="__main__")
except MemoryError:
    sys.stderr.write("MemoryError: the sandbox's memory limit\n"); sys.stderr.flush()
    os._exit(%d)
""" % MEMORY_EXIT


def _python(mode: str = "rlimits") -> str:
    """The base interpreter (not a venv's): the program gets the standard library only. Its path
    inside bubblewrap when ``mode`` is that (see ``_bwrap_args``)."""
    path = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if mode == "bubblewrap" and not prefix.startswith("/usr/") and path.startswith(prefix + "/"):
        return INSIDE_PYTHON + path[len(prefix):]
    return path


def _bwrap_args(workdir: str) -> List[str]:
    """bubblewrap: empty read-only root with /usr (and its /bin, /lib links), the interpreter's
    prefix, /proc, /dev, and the private directory as the only writable mount."""
    args = ["bwrap", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--die-with-parent", "--new-session", "--tmpfs", "/", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):  # e.g. pyenv's, under a private /root: shown at /python
        args += ["--ro-bind", prefix, INSIDE_PYTHON]
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", workdir, INSIDE_DIR, "--chdir", INSIDE_DIR,
             "--setenv", "HOME", INSIDE_DIR, "--setenv", "TMPDIR", INSIDE_DIR, "--remount-ro", "/"]
    if os.geteuid() == 0:  # the launcher switches to this run's own user id
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return args + ["--"]


def _unshare_args() -> List[str]:
    args = ["unshare", "--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        args.append("--map-root-user")
    return args + ["--"]


def _probe(mode: str) -> bool:
    """Whether ``mode`` runs a trivial program here (a missing binary, or a kernel or container
    that forbids namespaces, fails it)."""
    if mode == "rlimits":
        return True
    with tempfile.TemporaryDirectory(prefix=DIR_PREFIX) as workdir:
        prefix = _bwrap_args(workdir) if mode == "bubblewrap" else _unshare_args()
        try:
            done = subprocess.run(prefix + [_python(mode), "-I", "-c", "import os"], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0


@lru_cache(maxsize=None)
def isolation_mode() -> str:
    """The strongest isolation that works on this machine (or the one MEGATRON_RL_SANDBOX forces),
    logged once."""
    forced = os.environ.get(MODE_ENV)
    if forced:
        if forced not in MODES:
            raise ValueError(f"{MODE_ENV}={forced!r} is not an isolation mode; choose one of {', '.join(MODES)}")
        if not _probe(forced):
            raise RuntimeError(f"{MODE_ENV}={forced} does not work on this machine (bubblewrap: apt-get install "
                               f"bubblewrap; namespaces: unshare must be allowed); unset it to pick the best that does")
        mode = forced
    else:
        mode = next(m for m in MODES if _probe(m))
    level = logging.INFO if mode == "bubblewrap" else logging.WARNING
    logger.log(level, "code sandbox isolation: %s%s", mode, "" if mode == "bubblewrap" else
               " (bubblewrap not usable here: apt-get install bubblewrap for a private file system)")
    return mode


def _run_uid(mode: str) -> int:
    """A user id for one run when the trainer is root (-1 otherwise): random in a range no
    system account uses, so concurrent runs, even of different trainers, do not share one.
    Outside bubblewrap the program sees the host's files, so this needs an interpreter that any
    user may read (pyenv under a private /root is not)."""
    if os.geteuid() != 0 or (mode != "bubblewrap" and not _world_readable(sys.base_prefix)):
        return -1
    return random.randrange(1 << 20, 1 << 30)


@lru_cache(maxsize=None)
def _world_readable(path: str) -> bool:
    """Whether every directory down to ``path`` lets other users through."""
    path = os.path.realpath(path)
    while True:
        try:
            if not os.stat(path).st_mode & 0o005:
                return False
        except OSError:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    """All of ``stream``, keeping the first ``cap`` bytes (the rest is drained so that the program
    never blocks on a full pipe)."""
    kept = bytearray()
    while True:
        chunk = await stream.read(1 << 16)
        if not chunk:
            return bytes(kept)
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove(path: str) -> None:
    """Remove a run's directory, whatever permissions the program left on it."""
    def fix_and_retry(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix_and_retry)


async def run_python(code: str, stdin: str = "", limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox, feeding it ``stdin``; never raises for
    anything the program does."""
    limits = limits or SandboxLimits()
    mode = isolation_mode()
    root = os.environ.get(DIR_ENV) or None
    workdir = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=root)
    uid = _run_uid(mode)
    start = time.monotonic()
    proc = None
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as fh:
            fh.write(code)
        if uid >= 0:
            os.chown(workdir, uid, uid)
        inside = INSIDE_DIR if mode == "bubblewrap" else workdir
        prefix = {"bubblewrap": _bwrap_args(workdir), "namespaces+rlimits": _unshare_args(), "rlimits": []}[mode]
        argv = prefix + [_python(mode), "-I", "-c", _LAUNCHER, str(max(1, int(round(limits.cpu_s)))),
                         str(limits.memory_mb << 20), str(limits.max_processes), str(limits.max_file_mb << 20),
                         str(uid), os.path.join(inside, "main.py")]
        env = {"PATH": "/usr/bin:/bin", "HOME": inside, "TMPDIR": inside, "LANG": "C.UTF-8"}
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=workdir, env=env, start_new_session=True)
        cap = limits.max_output_bytes
        io = asyncio.gather(_feed(proc, stdin), _read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap),
                            proc.wait())
        try:
            _, out, err, returncode = await asyncio.wait_for(io, limits.wall_s)
        except asyncio.TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            return SandboxResult("timeout", None, "", f"killed after the wall-time limit of {limits.wall_s:g}s",
                                 time.monotonic() - start)
        exit_code = returncode
        if mode != "rlimits" and returncode > 128:  # the namespace's init reports a signal as 128 + N
            exit_code = -(returncode - 128)
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        return SandboxResult(_verdict(exit_code, stderr), exit_code, stdout, stderr, time.monotonic() - start)
    finally:
        if proc is not None:
            _kill_group(proc.pid)  # the program's own children, should it have left any (rlimits mode)
            if proc.returncode is None:
                await proc.wait()
        _remove(workdir)


async def _feed(proc: asyncio.subprocess.Process, stdin: str) -> None:
    try:
        if stdin:
            proc.stdin.write(stdin.encode("utf-8"))
            await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading its input


def _verdict(exit_code: int, stderr: str) -> str:
    if exit_code == 0:
        return "ok"
    if exit_code == MEMORY_EXIT or (stderr.rstrip().rsplit("\n", 1)[-1].startswith("MemoryError")):
        return "memory"
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):
        # SIGXCPU at the soft CPU limit, SIGKILL at the hard one a second later (a program that
        # handles SIGXCPU); the address-space limit makes allocations fail rather than the OOM killer.
        return "timeout"
    return "crash"
