"""What runs inside a reward worker process (``runner.RewardRunner`` starts them).

A reward is user code or a parser of model output, either of which may spin, hold the
interpreter lock in C (a catastrophic regex), call ``sys.exit`` or crash; in a process of its own
it can be killed at the timeout without taking the trainer with it. Each call scores a group's
completions (``RewardInput``: the completion, its acceptable answers and, for a ``reward.fn``,
the prompt, the token ids and the dataset row) in order and appends one line per finished
completion to a progress file, so that the trainer sees which one a killed call hung on and
keeps the scores before it.

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
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..plugins import PluginError

# One scored completion, as sent back to the trainer: ["ok", float, {extra metric: float}] |
# ["error", message] | ["stop", line].
# "stop" is a mistake in the reward itself (a wrong return type, a function the worker cannot
# load): every later call would repeat it, so the trainer stops with that one line.
Outcome = List[Any]
# Longest error message sent back per pair (a reward's exception may quote a whole completion).
MAX_MESSAGE_CHARS = 300
# Linux's prctl option that sends this process a signal when the thread that started it exits.
_PR_SET_PDEATHSIG = 1

_loaded: Dict[bytes, Callable] = {}


@dataclass(frozen=True)
class RewardInput:
    """One completion to score. Registered rewards read ``completion`` and ``targets`` only; the
    rest is filled for a ``reward.fn`` (``wants_context``), whose signature may ask for it."""

    completion: str
    # The acceptable answers as text, the main one first (a reward scored against each keeps the best).
    targets: Tuple[str, ...]
    # The prompt text the model was given and its token ids; the completion's token ids.
    prompt: str = ""
    prompt_ids: Tuple[int, ...] = ()
    completion_ids: Tuple[int, ...] = ()
    # The answer as the dataset row holds it (a number, a list, text); None: targets[0].
    ground_truth: Any = None
    # Every column of the dataset row (JSON values).
    row: Dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.targets[0]


class WrongReturn(TypeError):
    """A reward returned a value of the wrong type; the message starts ``returned ...``."""


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


def extra_metrics(value: Any) -> Dict[str, float]:
    """The numbers a reward's dict returns besides ``reward`` (``{"reward": 1, "format": 0.5}``:
    ``{"format": 0.5}``), logged as ``reward/extra/<key>``; other values (text, lists) are left out."""
    if not isinstance(value, dict):
        return {}
    extras = {}
    for key, item in value.items():
        number = None if key == "reward" else reward_number(item)
        if number is not None and number == number and abs(number) != float("inf"):
            extras[str(key)] = number
    return extras


def checked_value(value: Any) -> Any:
    """A reward's return value, awaited when it is a coroutine; WrongReturn when it is no reward."""
    value = awaited(value)
    problem = wrong_type(value)
    if problem is not None:
        raise WrongReturn(problem)
    return value


def best_of(score: Callable[[str], Any], targets: Sequence[str]) -> Any:
    """The return value of ``score(target)`` for the acceptable answer that scores highest (the
    first on a tie). WrongReturn at a value that is not a reward."""
    best, best_score = None, None
    for target in targets:
        value = checked_value(score(target))
        if best_score is None or as_reward(value) > best_score:
            best, best_score = value, as_reward(value)
    return best


def reward_of(fn: Callable, item: RewardInput) -> Any:
    """What ``fn`` returns for ``item``: a ``reward.fn`` wrapper reads what its signature asks
    (``score_input``); a registered reward is ``fn(completion, target)`` for each acceptable answer."""
    score_input = getattr(fn, "score_input", None)
    if score_input is not None:
        return score_input(item)
    return best_of(lambda target: fn(item.completion, target), item.targets)


def awaited(value: Any) -> Any:
    """The result of an ``async def`` reward (run to completion here: a worker has no loop)."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    return asyncio.run(wait())


def score_one(fn: Callable, label: str, item: RewardInput) -> Outcome:
    """One completion's outcome. Anything the reward raises, SystemExit and KeyboardInterrupt
    included, is an error of this completion: user code must not end the worker, let alone the run."""
    try:
        value = reward_of(fn, item)
    except PluginError as err:  # a reward.fn that returned the wrong type (rewards/user.py)
        return ["stop", str(err)]
    except WrongReturn as err:
        return ["stop", f"{label} {err}; return a float (an int, bool, numpy or torch scalar will do) "
                        "or a dict with a float 'reward'"]
    except BaseException as err:  # noqa: BLE001 - contained and counted by the trainer
        return ["error", error_text(err)]
    return ["ok", as_reward(value), extra_metrics(value)]


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


def score_items(payload: bytes, label: str, items: Sequence[RewardInput], progress_path: str) -> List[Outcome]:
    """Task: the outcome of each completion in order, each also appended to ``progress_path`` as
    one JSON line (in one write, so a line is whole or absent) the moment it is known."""
    fn = loaded(payload)
    outcomes: List[Outcome] = []
    fd = os.open(progress_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for item in items:
            outcome = score_one(fn, label, item)
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
