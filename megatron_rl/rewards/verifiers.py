"""Verifiable rewards: pure functions ``(completion_text, target) -> score in [0, 1]``, registered
under their ``reward.name`` in REWARDS."""

from __future__ import annotations

import re
from typing import Callable

from ..registry import Registry
from .code import code_tests
from .math_verifier import math_equal

RewardFn = Callable[[str, str], float]
# reward.name -> its verifier; the trainer scores every completion with REWARDS[cfg.reward.name].
REWARDS: Registry[RewardFn] = Registry("reward")


def digit_match(completion: str, target: str) -> float:
    """Partial credit for a digit string, counting the end of the answer as one more position.

    score = (digits matching the target position by position + [answer length is right])
            / (max(len(answer), len(target)) + 1)
    Too long and too short answers both lose credit, and stopping at the right place earns its
    own share, so the policy gets a signal for where to stop as well as for what to write.
    """
    if not target:
        raise ValueError("digit_match needs a non-empty target")
    answer = completion.strip()
    correct = sum(a == b for a, b in zip(answer, target)) + (len(answer) == len(target))
    return correct / (max(len(target), len(answer)) + 1)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_reference(target: str) -> float:
    """The reference number: GSM8K's raw answer text (worked solution, then ``#### <number>``, as a
    ``data.name=jsonl`` row holds it) or the bare number. Raises ValueError when there is none: a
    target the reward cannot read is an error counted in ``reward/errors``, not a silent zero."""
    text = target.rsplit("####", 1)[1] if "####" in target else target
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"the reference answer {target[-40:]!r} is not a number and has no '#### <number>'; "
                         "check data.answer_key") from None


def gsm8k_exact(completion: str, target: str) -> float:
    """1.0 when the number after the last ``####`` equals the reference answer, else 0.0."""
    reference = gsm8k_reference(target)
    if "####" not in completion:
        return 0.0
    match = _NUMBER.search(completion.rsplit("####", 1)[1])
    if match is None:
        return 0.0
    try:
        return float(float(match.group().replace(",", "")) == reference)
    except ValueError:
        return 0.0


# Both digit tasks score by position against the target the data set computed.
REWARDS.add("reverse_digits", digit_match)
REWARDS.add("sort_digits", digit_match)
REWARDS.add("gsm8k", gsm8k_exact)
# MATH-style answers (boxed LaTeX, fractions, intervals, units) through math-verify.
REWARDS.add("math", math_equal)
# Programs against stdin/stdout test cases (a JSON list) in the code sandbox.
REWARDS.add("code", code_tests)
