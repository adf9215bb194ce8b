"""The reward a config asks for: a registered one (``reward.name``) or the user's own function by
import path (``reward.fn=my_pkg.scoring:score``), loaded without editing this package.

A user reward is called as ``fn(completion, target)``; it may be ``async def`` (run to completion on
the scoring worker's thread) and returns a float or a dict with a float ``"reward"`` (other keys
are ignored). A path, signature or return value that is wrong stops the run with one line naming
``reward.fn``, what is wrong and the fix: a reward that returns the wrong type would otherwise
train on zeros without anyone noticing.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Tuple

from ..plugins import PluginError, check_callable, describe, load_object
from .verifiers import REWARDS

RewardFn = Callable[[str, str], float]
PARAMS = ("completion", "target")


def load_user_reward(spec: str) -> RewardFn:
    """The function at import path ``spec``, checked and wrapped to a plain ``(completion,
    target) -> float`` for the reward pool; PluginError (one line) when it cannot be."""
    fn = check_callable(load_object(spec, "reward.fn"), spec, "reward.fn", PARAMS)

    def user_reward(completion: str, target: str) -> float:
        value = fn(completion, target)
        if inspect.isawaitable(value):  # async def (or a plain function returning a coroutine)
            value = _await(value)
        return reward_value(value, spec)

    user_reward.__name__ = getattr(fn, "__name__", "user_reward")
    user_reward.__qualname__ = describe(fn, spec)
    return user_reward


def _await(awaitable: Any) -> Any:
    """Run a coroutine to completion on this (worker) thread, which has no event loop of its own."""
    async def wait():
        return await awaitable

    return asyncio.run(wait())


def reward_value(value: Any, spec: str) -> float:
    """The float a user reward returned: the value itself or its dict's ``"reward"``."""
    reward = value.get("reward") if isinstance(value, dict) else value
    if isinstance(value, dict) and "reward" not in value:
        raise PluginError(f"reward.fn={spec!r} returned a dict without 'reward' (keys: "
                          f"{', '.join(map(str, value)) or 'none'}); return a float or {{'reward': <float>, ...}}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        shown = repr(reward)
        shown = shown[:60] + "..." if len(shown) > 60 else shown
        what = "a dict whose 'reward' is " if isinstance(value, dict) else ""
        raise PluginError(f"reward.fn={spec!r} returned {what}{type(reward).__name__} {shown}; return a float "
                          "or a dict with a float 'reward'")
    return float(reward)  # NaN and inf are the pool's to count, like any failed score


def build_reward(reward_cfg) -> Tuple[RewardFn, str]:
    """``(fn, label)`` for ``reward.fn`` when set, else for ``reward.name``."""
    if reward_cfg.fn:
        return load_user_reward(reward_cfg.fn), f"reward.fn {reward_cfg.fn}"
    return REWARDS[reward_cfg.name], f"reward {reward_cfg.name}"
