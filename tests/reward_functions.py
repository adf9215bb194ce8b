"""Reward functions the reward tests run. Rewards run in worker processes, which import them by
module and name, so they live at the top level of a module that imports nothing heavy.

Rewards that misbehave once per run keep their state in files under ``$REWARD_TEST_DIR``: each
call may run in another worker process."""

import os
import re
import sys
import time
from pathlib import Path

from megatron_rl.rewards.verifiers import digit_match


def flaky(completion, target):
    """Raises on "boom", sleeps 30 s on "hang", 0.2 s on "slow"; 1.0 when the completion starts
    with the target, else 0.5."""
    if completion == "boom":
        raise ValueError("bad")
    if completion == "hang":
        time.sleep(30)
    if completion == "slow":
        time.sleep(0.2)  # each under the timeout, together over it: progress, not a hang
    return 1.0 if completion.startswith(target) else 0.5


# Values that are numbers but not usable rewards, by name (the target names one).
UNUSABLE = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "7": 7.0, "-2": -2.0, "1e300": 1e300}


def unusable_unless_ok(completion, target):
    return 1.0 if completion == "ok" else UNUSABLE[target]


# Values that are not numbers at all, by name.
WRONG_TYPES = {"none": None, "text": "1.0x", "list": [1.0]}


def wrong_type_unless_ok(completion, target):
    return 1.0 if completion == "ok" else WRONG_TYPES[target]


def numpy_scalars(completion, target):
    """What AReaL- and verl-style rewards return: numpy scalars, 0-d arrays and bools."""
    import numpy as np

    return {"f32": np.float32(0.5), "i64": np.int64(1), "bool": np.bool_(True), "0d": np.array(0.25),
            "true": True, "dict": {"reward": np.float64(0.75)}}[target]


def returns_text(completion, target):
    return "1.0"


def always_raises(completion, target):
    raise ValueError("this reward cannot read the target")


def length(completion, target):
    return len(completion) / 10


def counted_digit_match(completion, target):
    """digit_match, each call counted as a line of ``$REWARD_TEST_DIR/calls``."""
    with open(Path(os.environ["REWARD_TEST_DIR"]) / "calls", "a") as fh:
        fh.write("1\n")
    return digit_match(completion, target)


def sometimes_nan(completion, target):
    return float("nan") if completion[:1] in "0123" else digit_match(completion, target)


def huge(completion, target):
    """A reward of 1e300 for half the digits: float32 advantages overflow without reward.max_abs."""
    return 1e300 if completion[:1] in "01234" else 0.0


def _first_time(name: str) -> bool:
    """True once per run for ``name`` (a marker file holding the pid of the worker that took it)."""
    marker = Path(os.environ["REWARD_TEST_DIR"]) / name
    try:
        with open(marker, "x") as fh:
            fh.write(str(os.getpid()))
        return True
    except FileExistsError:
        return False


def misbehaves_once_each(completion, target):
    """On its first calls of a run: a Python busy loop, a catastrophic regex (holds the
    interpreter lock in C for hours), ``sys.exit(3)``; once more the regex after the file ``go``
    appears; digit_match otherwise."""
    if _first_time("spin"):
        while True:
            pass
    if _first_time("regex"):
        re.match(r"(a+)+$", "a" * 40 + "b")
    if _first_time("exit"):
        sys.exit(3)
    if (Path(os.environ["REWARD_TEST_DIR"]) / "go").exists() and _first_time("regex-on-request"):
        re.match(r"(a+)+$", "a" * 40 + "b")
    return digit_match(completion, target)


def spins(completion, target):
    """Writes its worker's pid, then spins forever."""
    _first_time(f"spin-{os.getpid()}")
    while True:
        pass


def hangs_every_29th_call(completion, target):
    """digit_match; every 29th call (counted across worker processes in ``$REWARD_TEST_DIR/calls``)
    first sleeps 3 s, longer than the tests' reward.timeout_s."""
    with open(Path(os.environ["REWARD_TEST_DIR"]) / "calls", "a+") as fh:
        fh.write("1\n")
        fh.flush()
        fh.seek(0)
        calls = len(fh.readlines())
    if calls % 29 == 0:
        time.sleep(3)
    return digit_match(completion, target)
