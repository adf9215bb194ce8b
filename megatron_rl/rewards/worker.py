"""What runs inside a reward worker process (``runner.RewardRunner`` starts them).

A reward is user code or a parser of model output, either of which may spin, hold the
interpreter lock in C (a catastrophic regex), call ``sys.exit`` or crash; in a process of its own
it can be killed at the timeout without taking the trainer with it. Each call scores a group's
(completion, target) pairs in order and appends one line per finished pair to a progress file,
so that the trainer sees which pair a killed call hung on and keeps the scores before it.

This module imports nothing heavy: a fresh worker starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import json
import logging
import numbers
import os
import pickle
import signal
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..plugins import PluginError

# One scored pair, as sent back to the trainer: ["ok", float] | ["error", message] | ["stop", line].
# "stop" is a mistake in the reward itself (a wrong return type, a function the worker cannot
# load): every later call would repeat it, so the trainer stops with that one line.
Outcome = List[Any]
# Longest error message sent back per pair (a reward's exception may quote a whole completion).
MAX_MESSAGE_CHARS = 300
# Linux's prctl option that sends this process a signal when the thread that started it exits.
_PR_SET_PDEATHSIG = 1

_loaded: Dict[bytes, Callable] = {}


class RewardLoadError(RuntimeError):
    """The reward function could not be rebuilt inside the worker (its module is not importable
    there); the trainer turns it into one line and stops."""


def init_worker(parent_pid: int) -> None:
    """Pool initializer: die with the trainer, and die at once when killed at a timeout."""
    # The pool stops a worker with SIGTERM; its default action needs no Python code to run, so
    # it ends a worker stuck in C (a regex holding the interpreter lock) at once, where a Python
    # handler would wait for the next bytecode.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the trainer ends, even by SIGKILL (Linux; a
    no-op elsewhere). A reward spinning in C would otherwise outlive a killed trainer."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the trainer died before the request was in place
        os._exit(1)


def reward_number(value: Any) -> Optional[float]:
    """``value`` as a float when it is a number: int, float, bool, a numpy scalar or 0-d array,
    a 0-d torch tensor (what AReaL and verl rewards return); None otherwise."""
    if isinstance(value, numbers.Real):  # bool, int, float, numpy's scalar types
        return float(value)
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        item = value.item()
        if isinstance(item, numbers.Real):
            return float(item)
    return None


def describe_value(value: Any) -> str:
    """What a reward returned, for the line that stops the run (``str '1.0'``, ``NoneType None``)."""
    shown = repr(value)
    shown = shown[:60] + "..." if len(shown) > 60 else shown
    return f"{type(value).__name__} {shown}"


def wrong_type(value: Any) -> Optional[str]:
    """None when ``value`` is a usable reward (a number, or a dict with a number under
    ``"reward"``); otherwise what is wrong with it, starting ``returned ...``."""
    if isinstance(value, dict):
        if "reward" not in value:
            return f"returned a dict without 'reward' (keys: {', '.join(map(str, value)) or 'none'})"
        inner = value["reward"]
        return None if reward_number(inner) is not None else f"returned a dict whose 'reward' is {describe_value(inner)}"
    return None if reward_number(value) is not None else f"returned {describe_value(value)}"


def as_reward(value: Any) -> float:
    """The score in a usable return value (see ``wrong_type``)."""
    return reward_number(value["reward"] if isinstance(value, dict) else value)


def awaited(value: Any) -> Any:
    """The result of an ``async def`` reward (run to completion here: a worker has no loop)."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    return asyncio.run(wait())


def score_one(fn: Callable, label: str, completion: str, target: str) -> Outcome:
    """One pair's outcome. Anything the reward raises, SystemExit and KeyboardInterrupt
    included, is an error of this pair: user code must not end the worker, let alone the run."""
    try:
        value = awaited(fn(completion, target))
    except PluginError as err:  # a reward.fn that returned the wrong type (rewards/user.py)
        return ["stop", str(err)]
    except BaseException as err:  # noqa: BLE001 - contained and counted by the trainer
        return ["error", error_text(err)]
    problem = wrong_type(value)
    if problem is not None:
        return ["stop", f"{label} {problem}; return a float (an int, bool, numpy or torch scalar will do) "
                        "or a dict with a float 'reward'"]
    return ["ok", as_reward(value)]


def error_text(err: BaseException) -> str:
    """``Type: message`` of an error (``SystemExit: 3``), cut to MAX_MESSAGE_CHARS."""
    message = str(err)
    return (f"{type(err).__name__}: {message}" if message else type(err).__name__)[:MAX_MESSAGE_CHARS]


def loaded(payload: bytes) -> Callable:
    """The reward function a payload names (module and name, or a ``reward.fn`` import path),
    imported once per worker."""
    fn = _loaded.get(payload)
    if fn is None:
        try:
            fn = pickle.loads(payload)
        except Exception as err:  # noqa: BLE001 - named in the one line the trainer stops with
            raise RewardLoadError(f"{type(err).__name__}: {err}") from None
        _loaded[payload] = fn
    return fn


def score_items(payload: bytes, label: str, items: Sequence[Tuple[str, str]], progress_path: str) -> List[Outcome]:
    """Task: the outcome of each pair in order, each also appended to ``progress_path`` as one
    JSON line (in one write, so a line is whole or absent) the moment it is known."""
    fn = loaded(payload)
    outcomes: List[Outcome] = []
    fd = os.open(progress_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for completion, target in items:
            outcome = score_one(fn, label, completion, target)
            outcomes.append(outcome)
            os.write(fd, (json.dumps(outcome) + "\n").encode())
            if outcome[0] == "stop":
                break  # the run stops at this line; the rest would say the same
    finally:
        os.close(fd)
    return outcomes


def warm_up(payload: bytes) -> None:
    """Task: import the reward in a fresh worker before the first group needs it."""
    loaded(payload)
