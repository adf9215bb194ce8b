"""The code sandbox (megatron_rl/rewards/sandbox.py): hostile programs are contained with the
right verdict, the test process (standing in for the trainer) is unharmed, and no process or
temp dir is left behind, also with 100 runs at once."""

import asyncio
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_rl.rewards import sandbox
from megatron_rl.rewards.sandbox import SandboxLimits, SandboxUnavailable, isolation_mode, run_python

PROJECT = Path(__file__).resolve().parents[1]
# Generous walls: the CI box is two loaded cores, and a verdict must not depend on its load.
LIMITS = SandboxLimits(wall_s=20.0, cpu_s=2.0, memory_mb=256, max_processes=16)


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Runs in a private parent dir, recording the user ids they ran under; afterwards checks
    that no process of theirs and no directory of theirs is left."""
    # Programs run as an unprivileged user when the tests run as root: the runs' parent dir must
    # let that user through (pytest's own tmp dir is private to root).
    root = Path(tempfile.mkdtemp(prefix="megatron_rl_sandbox_test_"))
    os.chmod(root, 0o711)
    monkeypatch.setenv(sandbox.DIR_ENV, str(root))
    uids = []
    real = sandbox._run_uid

    def recording(mode):
        uid = real(mode)
        uids.append(uid)
        return uid

    monkeypatch.setattr(sandbox, "_run_uid", recording)

    def go(code, stdin="", limits=LIMITS):
        return asyncio.run(run_python(code, stdin, limits))

    go.root, go.uids = root, uids
    # Children the test process had before (e.g. the multi-process tests' fork server) are not ours.
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    yield go
    leftovers = list(root.iterdir())
    shutil.rmtree(root, ignore_errors=True)
    assert leftovers == [], "a run's private directory was left behind"
    left_behind = [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert left_behind == [], "a sandbox process outlived its run"
    ours = {u for u in uids if u >= 0}

    def alive_of_ours():  # killed ones may take a moment to die, and to be reaped
        return [p.pid for p in psutil.process_iter(["uids", "status"]) if p.info["uids"]
                and p.info["uids"].real in ours and p.info["status"] != psutil.STATUS_ZOMBIE]

    deadline = time.time() + 3
    while alive_of_ours() and time.time() < deadline:
        time.sleep(0.1)
    left = alive_of_ours()
    assert not left, f"processes of the runs' user ids are still alive: {left}"


def test_mode_is_the_strongest_available():
    assert isolation_mode() in sandbox.MODES
    if shutil.which("bwrap"):
        assert isolation_mode() == "bubblewrap"  # installed by .ci/run: CI runs the full isolation


def test_ok_reads_stdin_and_uses_its_private_dir(runs):
    result = runs("import os\nopen('f.txt', 'w').write(input()[::-1])\nprint(open('f.txt').read(), os.getcwd() != '/')",
                  "hello")
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "olleh True\n")


def test_exit_codes_and_signals_are_crashes(runs):
    assert (runs("raise SystemExit(3)").status, runs("raise SystemExit(3)").exit_code) == ("crash", 3)
    boom = runs("raise ValueError('no')")
    assert boom.status == "crash" and "ValueError: no" in boom.stderr
    segv = runs("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert (segv.status, segv.exit_code) == ("crash", -11)


def test_infinite_loop_is_a_timeout_by_cpu_limit(runs):
    result = runs("while True:\n    pass", limits=SandboxLimits(wall_s=30.0, cpu_s=1.0))
    assert result.status == "timeout"


def test_sleeping_program_is_killed_at_the_wall_limit(runs):
    result = runs("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=1.0))
    assert (result.status, result.exit_code) == ("timeout", None)
    assert result.wall_s < 10


def test_ten_gigabytes_is_a_memory_verdict(runs):
    result = runs("x = bytearray(10 * 1024 ** 3)\nprint('allocated')")
    assert result.status == "memory" and "allocated" not in result.stdout


def test_fork_bomb_is_contained(runs):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = runs(bomb, limits=SandboxLimits(wall_s=3.0, cpu_s=2.0, max_processes=16))
    assert result.status in ("timeout", "crash")
    # The trainer is unharmed: it still starts processes and runs programs.
    assert runs("print(6 * 7)").stdout == "42\n"


def test_output_is_capped(runs):
    result = runs("import sys\nsys.stdout.write('x' * 5_000_000)",
                  limits=SandboxLimits(wall_s=20.0, max_output_bytes=1000))
    assert result.status == "ok" and result.stdout == "x" * 1000


def _needs_bubblewrap():
    if isolation_mode() != "bubblewrap":
        pytest.skip(f"file and network walls need bubblewrap; isolation here is {isolation_mode()}")


def test_reading_outside_the_private_dir_fails(runs):
    _needs_bubblewrap()
    secret = PROJECT / "setup.py"
    result = runs(f"print(open({str(secret)!r}).read()[:20])")
    assert result.status == "crash" and "FileNotFoundError" in result.stderr
    assert runs("print(open('/etc/passwd').read())").status == "crash"


def test_writing_to_the_project_tree_fails(runs):
    _needs_bubblewrap()
    target = PROJECT / "sandbox_escape.txt"
    result = runs(f"open({str(target)!r}, 'w').write('x')")
    assert result.status == "crash" and not target.exists()
    assert runs("open('/usr/escape.txt', 'w').write('x')").status == "crash"
    assert not Path("/usr/escape.txt").exists()


def test_no_network(runs):
    _needs_bubblewrap()
    result = runs("import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))\nprint('connected')")
    assert result.status == "crash" and "connected" not in result.stdout
    assert "Network is unreachable" in result.stderr


def test_hundred_concurrent_runs_leave_nothing_behind(runs):
    """100 runs at once, every tenth one hung until the wall limit: all verdicts right, and the
    fixture checks no process and no directory survives."""
    async def many():
        jobs = []
        for i in range(100):
            code = "import time\ntime.sleep(60)" if i % 10 == 0 else "print(sum(range(int(input()))))"
            limits = SandboxLimits(wall_s=2.0) if i % 10 == 0 else SandboxLimits(wall_s=60.0)
            jobs.append(run_python(code, str(i), limits))
        return await asyncio.gather(*jobs)

    results = asyncio.run(many())
    for i, result in enumerate(results):
        if i % 10 == 0:
            assert result.status == "timeout"
        else:
            assert (result.status, result.stdout) == ("ok", f"{sum(range(i))}\n"), result.stderr[-300:]
    assert len([u for u in runs.uids if u >= 0]) in (0, 100)


def test_forced_unknown_mode_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "chroot")
    sandbox.isolation_mode.cache_clear()
    try:
        with pytest.raises(ValueError, match="MEGATRON_RL_SANDBOX='chroot' is not an isolation mode"):
            isolation_mode()
    finally:
        sandbox.isolation_mode.cache_clear()


# ---- Hostile programs, in every isolation mode this machine offers ----------------------------
# A weak mode (no private file system or network) refuses to run programs unless weak isolation
# is allowed (sandbox.allow_weak_isolation); allowed, it still keeps the trainer and the
# project safe, never runs the program as root, and leaves no process behind. When the tests
# run as root, the trainer's interpreter is made to live under a root-only directory, as pyenv's
# or conda's under /root do.


def _clear_caches():
    for cached in (sandbox.isolation_mode, sandbox.program_python, sandbox._enterable):
        cached.cache_clear()


@pytest.fixture
def private_python(tmp_path, monkeypatch):
    """As root: the base interpreter seen through a symlink in a 0700 directory (what the
    unprivileged user cannot enter). Otherwise the interpreter as it is."""
    if os.geteuid() == 0:
        exe, prefix = sandbox._base_interpreter()
        private = tmp_path / "root_only"
        private.mkdir(mode=0o700)
        (private / "py").symlink_to(prefix)
        inside = str(private / "py") + exe[len(prefix):] if exe.startswith(prefix + "/") else exe
        monkeypatch.setattr(sandbox, "_base_interpreter", lambda: (inside, str(private / "py")))
        assert not sandbox._runs_unprivileged(inside)  # really unreadable to the program's user
    _clear_caches()
    yield
    _clear_caches()


@pytest.fixture(params=sandbox.MODES)
def mode(request, monkeypatch, private_python):
    """Each isolation mode in turn, forced; weak ones allowed (the user's key). Skipped where the
    machine does not offer it."""
    monkeypatch.setenv(sandbox.MODE_ENV, request.param)
    monkeypatch.delenv(sandbox.PYTHON_ENV, raising=False)
    if request.param not in sandbox.STRONG_MODES:
        monkeypatch.setenv(sandbox.ALLOW_WEAK_ENV, "1")
    try:
        isolation_mode()
    except SandboxUnavailable as err:
        pytest.skip(f"{request.param} is not offered here: {err}")
    if os.geteuid() != 0 and request.param == "rlimits":
        pytest.skip("rlimits as a non-root trainer runs programs as the trainer's own user: allowed only "
                    "with sandbox.allow_weak_isolation, nothing to test but the refusal")
    return request.param


def test_weak_modes_refuse_unless_allowed(mode, monkeypatch):
    monkeypatch.delenv(sandbox.ALLOW_WEAK_ENV, raising=False)
    if mode in sandbox.STRONG_MODES:
        assert asyncio.run(run_python("print(1)")).stdout == "1\n"
        return
    with pytest.raises(SandboxUnavailable) as info:
        asyncio.run(run_python("print(1)"))
    assert f"isolation here is {mode}" in str(info.value)
    assert "sandbox.allow_weak_isolation=true" in str(info.value) and "\n" not in str(info.value)


def test_program_never_runs_as_root(runs, mode):
    result = runs("import os\nprint(os.getuid(), os.geteuid(), os.getgid())")
    assert result.status == "ok", result.stderr
    uid, euid, gid = map(int, result.stdout.split())
    assert uid != 0 and euid != 0 and gid != 0


def test_hostile_write_into_the_project_fails(runs, mode):
    targets = [PROJECT / "megatron_rl" / "sandbox_escape.py", PROJECT / "sandbox_escape.txt"]
    code = "\n".join(f"try:\n    open({str(t)!r}, 'w').write('x')\n    print('wrote')\nexcept OSError:\n    pass"
                     for t in targets)
    result = runs(code)
    escaped = [t for t in targets if t.exists()]
    for t in escaped:
        t.unlink()
    assert not escaped and "wrote" not in result.stdout, (escaped, result)


def test_hostile_fill_of_host_tmp_and_shm_stays_inside(runs, mode):
    if mode == "rlimits":
        pytest.skip("rlimits (weak, allowed only by the key) does not wall off host files")
    token = f"sandbox_fill_{uuid.uuid4().hex}"
    places = [Path(d) / token for d in ("/tmp", "/var/tmp", "/dev/shm")]
    code = ("import sys\n" + "".join(
        f"try:\n    open({str(p)!r}, 'wb').write(b'x' * (4 << 20))\nexcept OSError as e:\n    print(e)\n"
        for p in places))
    runs(code)
    leaked = [p for p in places if p.exists()]
    for p in leaked:
        p.unlink()
    assert not leaked


def test_hostile_fork_bomb_stops_at_max_processes(runs, mode):
    code = ("import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        os.close(1); os.close(2); time.sleep(30)\n"
            "        os._exit(0)\n    n += 1\nprint(n)")
    result = runs(code, limits=SandboxLimits(wall_s=20.0, cpu_s=5.0, max_processes=16))
    assert result.status == "ok", result.stderr
    assert int(result.stdout) < 16


def test_hostile_umount_proc_and_setns_do_not_reach_the_host_network(runs, mode):
    if mode == "rlimits":
        pytest.skip("rlimits (weak, allowed only by the key) shares the host's network")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    code = ("import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.umount2(b'/proc', 2)\n"
            "for pid in os.listdir('/proc'):\n    try:\n        fd = os.open(f'/proc/{pid}/ns/net', os.O_RDONLY)\n"
            "        if libc.setns(fd, 0) == 0:\n            print('joined', pid)\n    except (OSError, ValueError):\n"
            "        pass\ns = socket.socket()\ns.settimeout(2)\ntry:\n"
            f"    s.connect(('127.0.0.1', {port}))\n    print('connected')\nexcept OSError as e:\n    print('no', e)")
    try:
        result = runs(code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert "connected" not in result.stdout and "joined" not in result.stdout, result


def test_hostile_setsid_daemon_does_not_outlive_the_run(runs, mode):
    token = f"sandbox_daemon_{uuid.uuid4().hex}"
    code = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        fd = os.open(os.devnull, os.O_RDWR)\n        for f in (0, 1, 2):\n            os.dup2(fd, f)\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)  # {token}'])\n"
            "    os._exit(0)\ntime.sleep(1)\nprint('parent done')")
    result = runs(code)
    assert result.stdout == "parent done\n", result
    time.sleep(0.5)
    alive = [p.pid for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or [])]
    for pid in alive:
        os.kill(pid, 9)
    assert not alive


def test_hostile_kill_of_the_caller_fails(runs, mode):
    code = ("import os\nfor target in (os.getppid(), 1):\n    try:\n        os.kill(target, 9)\n"
            "        print('killed', target)\n    except OSError as e:\n        print('refused', target, e.errno)")
    result = runs(code)
    assert "killed" not in result.stdout, result  # and this process, the caller's caller, lives


def test_root_with_an_unreadable_python_and_no_system_python_refuses(private_python, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("programs run as the trainer's user when it is not root")
    monkeypatch.setattr(sandbox, "SYSTEM_PYTHONS", ())
    monkeypatch.delenv(sandbox.PYTHON_ENV, raising=False)
    for weak in ("namespaces+rlimits", "rlimits"):
        monkeypatch.setenv(sandbox.MODE_ENV, weak)
        _clear_caches()
        with pytest.raises(SandboxUnavailable) as info:
            isolation_mode()
        assert "who cannot read this Python" in str(info.value) and "set sandbox.python" in str(info.value)
        assert "\n" not in str(info.value)
    monkeypatch.setenv(sandbox.PYTHON_ENV, sandbox._base_interpreter()[0])
    _clear_caches()
    with pytest.raises(SandboxUnavailable, match="cannot be run by an unprivileged user"):
        isolation_mode()
