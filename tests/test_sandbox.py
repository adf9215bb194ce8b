"""The code sandbox (megatron_rl/rewards/sandbox.py): hostile programs are contained with the
right verdict, the test process (standing in for the trainer) is unharmed, and no process or
temp dir is left behind, also with 100 runs at once."""

import asyncio
import os
import shutil
from pathlib import Path

import psutil
import pytest

from megatron_rl.rewards import sandbox
from megatron_rl.rewards.sandbox import SandboxLimits, isolation_mode, run_python

PROJECT = Path(__file__).resolve().parents[1]
# Generous walls: the CI box is two loaded cores, and a verdict must not depend on its load.
LIMITS = SandboxLimits(wall_s=20.0, cpu_s=2.0, memory_mb=256, max_processes=16)


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Runs in a private parent dir, recording the user ids they ran under; afterwards checks
    that no process of theirs and no directory of theirs is left."""
    root = tmp_path / "sandboxes"
    root.mkdir()
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
    assert list(root.iterdir()) == [], "a run's private directory was left behind"
    left_behind = [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert left_behind == [], "a sandbox process outlived its run"
    ours = {u for u in uids if u >= 0}
    left = [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in ours]
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
