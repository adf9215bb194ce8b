"""A preloaded Python for the documentation's commands, so that running every command of the docs
through bash costs seconds, not the ~7 CPU-seconds each interpreter spends importing torch,
megatron-core and the trainer.

    python tests/doc_python.py serve SOCKET      # imports once, then forks one child per request
    python tests/doc_python.py client ARGS...    # what a shim `.venv/bin/python` execs: runs ARGS
                                                 # in a child of the server, exits with its status

The client hands the server its argv, working directory, environment and its stdin/stdout/stderr
(as file descriptors over the Unix socket); the child takes them over and runs the arguments as
the interpreter would (``-m module``, ``-c code`` or a script, ``PYTHONPATH`` in front of
sys.path), then reports its exit status. The commands themselves run literally in bash: exports,
environment assignments, ``bash launch/local.sh`` through launch/env.sh; only the interpreter's
start is shared. A client that goes away (killed at a timeout) takes its child's process group
with it.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import socket
import sys
import threading
from typing import List

SOCKET_ENV = "MEGATRON_RL_DOC_PYTHON_SOCKET"
# Imports only: no process group, no threads, nothing a forked child could find half-done.
PRELOAD = ["torch", "megatron.core", "transformers", "megatron_rl.main", "megatron_rl.trainer", "megatron_rl.eval",
           "megatron_rl.slurm", "megatron_rl.checkpoint.convert"]
# Interpreter flags that change nothing here (unbuffered output, no .pyc files, ...).
IGNORED_FLAGS = ("-u", "-B", "-E", "-s", "-I", "-O", "-OO")


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a module this checkout does not have: the child imports what it needs
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are waited for
            os.setpgrp()
            _child(conn)  # never returns
        conn.close()


def _child(conn: socket.socket) -> None:
    code = 1
    try:
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        payload = b""
        while not payload.endswith(b"\n"):
            chunk = conn.recv(1 << 16)
            if not chunk:
                os._exit(1)
            payload += chunk
        request = json.loads(payload)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        conn.sendall(f"pid {os.getpid()}\n".encode())
        threading.Thread(target=_die_with_client, args=(conn,), daemon=True).start()
        code = _run_python(request["argv"])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        conn.sendall(f"exit {code}\n".encode())
    finally:
        os._exit(code)


def _die_with_client(conn: socket.socket) -> None:
    """The client closes its end only by exiting: then nobody waits for this command any more."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def _run_python(argv: List[str]) -> int:
    args = list(argv)
    while args and args[0] in IGNORED_FLAGS:
        args.pop(0)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *[p for p in sys.path[1:] if p not in extra]]
    if not args:
        raise SystemExit("doc_python: an interactive interpreter is not a documented command")
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.modules.pop(args[1], None)  # preloaded as a module: it runs afresh as __main__, as in python -m
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
    elif args[0].startswith("-"):
        raise SystemExit(f"doc_python: the interpreter flag {args[0]} is not supported here")
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")
    return 0


def client(argv: List[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[SOCKET_ENV])
    socket.send_fds(conn, [b"r"], [0, 1, 2])
    conn.sendall(json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\n")
    reader = conn.makefile("r")
    pid = int(reader.readline().split()[1])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    line = reader.readline()
    return int(line.split()[1]) if line.startswith("exit ") else 1


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[2:]))
