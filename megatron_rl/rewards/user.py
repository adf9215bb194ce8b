"""The reward a config asks for: a registered one (``reward.name``) or the user's own function by
import path (``reward.fn=my_pkg.scoring:score``), loaded without editing this package.

A user reward is called as ``fn(completion, target)``; it may be ``async def`` and returns a
number (a float, int, bool, numpy or torch scalar) or a dict with a number under ``"reward"``
(other keys are ignored). A path, signature or return value that is wrong stops the run with one
line naming ``reward.fn``, what is wrong and the fix: a reward that returns the wrong type would
otherwise train on zeros without anyone noticing.

Rewards run in worker processes (rewards/runner.py), so what the pool hands them is a value
that names the function, never the function object: a ``reward.fn`` is imported again, by its
path, inside each worker.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from ..plugins import PluginError, check_callable, load_object
from .verifiers import REWARDS
from .worker import as_reward, awaited, wrong_type

RewardFn = Callable[[str, str], float]
PARAMS = ("completion", "target")


class UserReward:
    """``reward.fn``'s function as a plain ``(completion, target) -> float``: awaited when it is
    ``async``, its value checked. Pickles as its import path, loaded where it is first called."""

    def __init__(self, spec: str, fn: Optional[Callable] = None):
        self.spec = spec
        self._fn = fn

    @property
    def function(self) -> Callable:
        """The user's function, imported and its signature checked (PluginError when it cannot be)."""
        if self._fn is None:
            self._fn = check_callable(load_object(self.spec, "reward.fn"), self.spec, "reward.fn", PARAMS)
        return self._fn

    def __call__(self, completion: str, target: str) -> float:
        return reward_value(awaited(self.function(completion, target)), self.spec)

    def __reduce__(self):
        return UserReward, (self.spec,)

    def __repr__(self) -> str:
        return f"UserReward({self.spec!r})"


def load_user_reward(spec: str) -> UserReward:
    """The function at import path ``spec``, checked now (PluginError, one line, when it cannot be
    used) and wrapped to a plain ``(completion, target) -> float`` for the reward pool."""
    reward = UserReward(spec)
    reward.function  # noqa: B018 - imported and checked here, before any worker starts
    return reward


def reward_value(value: Any, spec: str) -> float:
    """The float a user reward returned: the number itself or its dict's ``"reward"``."""
    problem = wrong_type(value)
    if problem is not None:
        raise PluginError(f"reward.fn={spec!r} {problem}; return a float (an int, bool, numpy or torch scalar will "
                          "do) or a dict with a float 'reward'")
    return as_reward(value)  # NaN and inf are the pool's to count, like any failed score


def build_reward(reward_cfg) -> Tuple[RewardFn, str]:
    """``(fn, label)`` for ``reward.fn`` when set, else for ``reward.name``."""
    if reward_cfg.fn:
        return load_user_reward(reward_cfg.fn), f"reward.fn {reward_cfg.fn}"
    return REWARDS[reward_cfg.name], f"reward {reward_cfg.name}"
