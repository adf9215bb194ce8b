"""Run untrusted Python (model-written programs, tool calls) in a contained child process.

Each run gets a fresh private directory (its working directory, ``HOME`` and ``TMPDIR``; removed
afterwards) and these limits (``SandboxLimits``): wall time, CPU time, address space, process
count, output size and file size. How much else is walled off depends on what the machine offers,
chosen once per process and logged (``isolation_mode()``):

- ``bubblewrap`` (Debian's ``bwrap``): no network, its own PID/IPC/UTS namespaces, a root file
  system that holds only the interpreter and system libraries, read-only, plus the private
  directory as the one writable place; nothing else of the host is visible.
- ``namespaces+rlimits`` (util-linux ``unshare``): no network, its own PID, mount, IPC and UTS
  namespaces, private ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (when the trainer is root), the
  rlimits; the rest of the host's files stay visible (read-only to the program, which runs as an
  unprivileged user).
- ``rlimits``: resource limits, a process group and (trainer as root) a user id of its own only;
  network and files are not walled off.

Only ``bubblewrap`` gives a private file system and no network. The others are *weak*: code
rewards and tool-using agents refuse them (``SandboxUnavailable``, one line) unless weak
isolation is allowed (``sandbox.allow_weak_isolation=true``, which sets ``ALLOW_WEAK_ENV``).

A program never runs as root. When the trainer runs as root every run gets a user id of its own
(so the process-count limit, counted per user by the kernel, counts only that run's processes,
and every process of the run is killed at its end, daemons included); that user must be able to
read the interpreter. Outside bubblewrap an interpreter under a private directory (pyenv or
conda under /root) cannot be, so the sandbox takes ``sandbox.python`` (``PYTHON_ENV``), else a
system ``python3``, else refuses saying what to install. Programs see the standard library only
(``python -I``), never the trainer's packages.

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
from typing import List, Optional, Tuple

logger = logging.getLogger(__name__)

# Forces an isolation mode (bubblewrap | namespaces+rlimits | rlimits) instead of the best one
# found; a forced mode that does not work here is an error at the first run.
MODE_ENV = "MEGATRON_RL_SANDBOX"
# "1": run programs in a weak mode (no private file system or network) instead of refusing.
ALLOW_WEAK_ENV = "MEGATRON_RL_SANDBOX_ALLOW_WEAK"
# The interpreter programs run with outside bubblewrap (one an unprivileged user can read).
PYTHON_ENV = "MEGATRON_RL_SANDBOX_PYTHON"
# Parent directory of the runs' private directories (default: the system temp dir).
DIR_ENV = "MEGATRON_RL_SANDBOX_DIR"
DIR_PREFIX = "megatron_rl_sandbox_"
MODES = ("bubblewrap", "namespaces+rlimits", "rlimits")
# The modes that give the program a private file system and no network.
STRONG_MODES = ("bubblewrap",)
# Interpreters tried, in order, when the trainer's own cannot be read by an unprivileged user.
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
# The user id a run's programs get when the trainer is root is drawn from [UID_LOW, UID_HIGH),
# a range no system account uses.
UID_LOW, UID_HIGH = 1 << 20, 1 << 30


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run programs here as configured (one line saying what to do)."""
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
cpu, mem, nproc, fsize, uid, private_tmp = map(int, sys.argv[1:7]); path = sys.argv[7]
if os.getpid() == 1:
    child = os.fork()
    if child:
        while True:
            pid, status = os.wait()
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                os._exit(128 - code if code < 0 else code)
if private_tmp:  # root in a mount namespace of its own: empty /tmp, /var/tmp, /dev/shm, the run's dir kept
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.getcwd(); keep = os.open(here, os.O_RDONLY | os.O_DIRECTORY)
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d) and libc.mount(b"tmpfs", d.encode(), b"tmpfs", 2 | 4 | 8, b"mode=1777,size=%d" % fsize):
            sys.stderr.write("sandbox: cannot mount a private %s (errno %d)\n" % (d, ctypes.get_errno())); os._exit(1)
    if not os.path.isdir(here):  # the run's dir was under one of them: show it again at its path
        os.makedirs(here)
        if libc.mount(b"/proc/self/fd/%d" % keep, here.encode(), None, 4096, None):
            sys.stderr.write("sandbox: cannot mount the run's directory (errno %d)\n" % ctypes.get_errno()); os._exit(1)
    os.chdir(here); os.close(keep)
R.setrlimit(R.RLIMIT_CORE, (0, 0))
R.setrlimit(R.RLIMIT_CPU, (cpu, cpu + 1))
R.setrlimit(R.RLIMIT_AS, (mem, mem))
R.setrlimit(R.RLIMIT_FSIZE, (fsize, fsize))
R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
if uid >= 0:
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
sys.argv = [path]
del cpu, mem, nproc, fsize, uid, private_tmp
try:
    runpy.run_path(path, run_name="__main__")
except MemoryError:
    sys.stderr.write("MemoryError: the sandbox's memory limit\n"); sys.stderr.flush()
    os._exit(MEMORY_EXIT)
""".replace("MEMORY_EXIT", str(MEMORY_EXIT))


def _base_interpreter() -> Tuple[str, str]:
    """The trainer's base interpreter (not a venv's: programs get the standard library only) and
    its installation prefix."""
    return (os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable),
            os.path.realpath(sys.base_prefix))


def _python(mode: str = "rlimits") -> str:
    """The interpreter programs run with in ``mode``: the base interpreter, at its path inside
    bubblewrap (see ``_bwrap_args``); outside bubblewrap one the program's user can read
    (``program_python``)."""
    path, prefix = _base_interpreter()
    if mode == "bubblewrap":
        if not prefix.startswith("/usr/") and path.startswith(prefix + "/"):
            return INSIDE_PYTHON + path[len(prefix):]
        return path
    return program_python()


@lru_cache(maxsize=None)
def program_python() -> str:
    """Outside bubblewrap, the interpreter for programs: ``PYTHON_ENV``'s, else (trainer as root,
    whose programs run as an unprivileged user) the base interpreter if that user can run it,
    else a system python3 that user can run. SandboxUnavailable when there is none."""
    forced = os.environ.get(PYTHON_ENV)
    base = _base_interpreter()[0]
    if os.geteuid() != 0:
        return forced or base
    if forced:
        if not _runs_unprivileged(forced):
            raise SandboxUnavailable(
                f"sandbox.python={forced!r} cannot be run by an unprivileged user (the sandbox never runs "
                "programs as root): give a Python 3 that every user may read and execute, e.g. /usr/bin/python3")
        return forced
    for candidate in (base, *SYSTEM_PYTHONS):
        if _runs_unprivileged(candidate):
            if candidate != base:
                logger.info("code sandbox: programs run with %s (this Python, %s, is in a directory other users "
                            "cannot read)", candidate, base)
            return candidate
    raise SandboxUnavailable(
        f"the code sandbox runs programs as an unprivileged user, who cannot read this Python ({base}: a "
        "directory above it is private, e.g. /root), and there is no system python3: install bubblewrap "
        "(apt-get install bubblewrap), or a system Python (apt-get install python3), or set sandbox.python "
        "to a Python 3 every user may read")


def _runs_unprivileged(python: str) -> bool:
    """Whether a user id of the sandbox's range runs ``python`` with its standard library."""
    if not os.path.isfile(python):
        return False
    uid = random.randrange(UID_LOW, UID_HIGH)
    try:
        done = subprocess.run([python, "-I", "-c", "import json, resource, runpy"], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"},
                              user=uid, group=uid, extra_groups=[])
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


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
    prefix = _base_interpreter()[1]
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
            python = _python(mode)
        except SandboxUnavailable:
            return False
        try:
            done = subprocess.run(prefix + [python, "-I", "-c", "import os"], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0


@lru_cache(maxsize=None)
def isolation_mode() -> str:
    """The strongest isolation that works on this machine (or the one MEGATRON_RL_SANDBOX forces).
    SandboxUnavailable when none can run programs (see ``program_python``)."""
    forced = os.environ.get(MODE_ENV)
    if forced:
        if forced not in MODES:
            raise ValueError(f"{MODE_ENV}={forced!r} is not an isolation mode; choose one of {', '.join(MODES)}")
        if forced != "bubblewrap":
            program_python()  # raises with what to do when no interpreter can be read
        if not _probe(forced):
            raise SandboxUnavailable(f"sandbox mode {forced} does not work on this machine (bubblewrap: apt-get "
                                     "install bubblewrap; namespaces: unshare must be allowed); set sandbox.mode=auto "
                                     "to pick the best that does")
        return forced
    for mode in MODES:
        if _probe(mode):
            return mode
    program_python()  # only the interpreter can fail rlimits' probe: raise saying what to do
    raise SandboxUnavailable("the code sandbox cannot start a program on this machine")


def weak_allowed() -> bool:
    """Whether programs may run in a weak mode (``ALLOW_WEAK_ENV``)."""
    return os.environ.get(ALLOW_WEAK_ENV, "").lower() in ("1", "true", "yes")


def refusal(mode: str) -> Optional[str]:
    """Why programs may not run in ``mode`` (None: they may)."""
    if mode in STRONG_MODES or weak_allowed():
        return None
    return (f"the code sandbox's isolation here is {mode}, which gives programs neither a private file system "
            "nor (rlimits) a network of their own: install bubblewrap (apt-get install bubblewrap, or bash "
            "launch/env.sh as root), or set sandbox.allow_weak_isolation=true to run model-written code anyway")


def describe(mode: str) -> str:
    """One log line: the mode and what it walls off."""
    what = {"bubblewrap": "private file system, no network, own PID namespace",
            "namespaces+rlimits": "no network, own PID namespace, host files visible (weak)",
            "rlimits": "resource limits only: host files and network reachable (weak)"}[mode]
    user = "an unprivileged user id per run" if os.geteuid() == 0 else f"this user (uid {os.geteuid()})"
    return f"code sandbox isolation: {mode} ({what}; programs run as {user})"


def check_allowed() -> str:
    """The isolation mode, after checking that programs may run in it (SandboxUnavailable, one
    line, when they may not)."""
    mode = isolation_mode()
    reason = refusal(mode)
    if reason:
        raise SandboxUnavailable(reason)
    return mode


def configure(mode: str = "auto", allow_weak: bool = False, python: Optional[str] = None) -> str:
    """Set the sandbox up for this process and the worker processes it starts later (through the
    environment): the mode (``auto``: the strongest this machine offers, or ``MODE_ENV``'s),
    whether weak modes may run, the interpreter outside bubblewrap. Returns the mode in use;
    SandboxUnavailable (one line) when programs may not run."""
    if mode != "auto":
        os.environ[MODE_ENV] = mode
    if allow_weak:
        os.environ[ALLOW_WEAK_ENV] = "1"
    if python:
        os.environ[PYTHON_ENV] = python
    isolation_mode.cache_clear()
    program_python.cache_clear()
    mode = check_allowed()
    os.environ[MODE_ENV] = mode  # workers use it without probing again
    return mode


def _run_uid(mode: str) -> int:
    """A user id for one run when the trainer is root (-1 otherwise): random in a range no
    system account uses, so concurrent runs, even of different trainers, do not share one."""
    if os.geteuid() != 0:
        return -1
    return random.randrange(UID_LOW, UID_HIGH)


@lru_cache(maxsize=None)
def _enterable(path: str) -> bool:
    """Whether every directory down to ``path`` lets other users through."""
    path = os.path.realpath(path)
    while True:
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def _kill_uid(uid: int) -> None:
    """Kill every process of user ``uid`` (a run's leftovers: a double-forked, setsid daemon
    escapes the process group and, outside a PID namespace, outlives the run)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)  # every process this user may signal: its own
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


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
    mode = check_allowed()
    root = os.environ.get(DIR_ENV) or None
    uid = _run_uid(mode)
    if uid >= 0 and mode != "bubblewrap" and not _enterable(root or tempfile.gettempdir()):
        raise SandboxUnavailable(f"the code sandbox's directory {root or tempfile.gettempdir()} is inside a directory "
                                 f"other users cannot enter, so the unprivileged user programs run as cannot reach "
                                 f"its files: set {DIR_ENV} to a directory such as /tmp")
    workdir = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=root)
    start = time.monotonic()
    proc = None
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as fh:
            fh.write(code)
        if uid >= 0:
            os.chown(workdir, uid, uid)
        inside = INSIDE_DIR if mode == "bubblewrap" else workdir
        prefix = {"bubblewrap": _bwrap_args(workdir), "namespaces+rlimits": _unshare_args(), "rlimits": []}[mode]
        private_tmp = int(mode == "namespaces+rlimits" and os.geteuid() == 0)
        argv = prefix + [_python(mode), "-I", "-c", _LAUNCHER, str(max(1, int(round(limits.cpu_s)))),
                         str(limits.memory_mb << 20), str(limits.max_processes), str(limits.max_file_mb << 20),
                         str(uid), str(private_tmp), os.path.join(inside, "main.py")]
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
        if uid >= 0:
            _kill_uid(uid)  # and any that left the process group (setsid)
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
