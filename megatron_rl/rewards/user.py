"""The reward a config asks for: a registered one (``reward.name``) or the user's own function by
import path (``reward.fn=my_pkg.scoring:score``), loaded without editing this package.

A user reward has one of three signatures, told apart when the config is checked:

- ours: ``fn(completion, target)``; parameters after these two are filled by name from the
  dataset row's fields (``fn(completion, target, difficulty)``), ``**row`` receives them all;
- verl's: ``compute_score(data_source, solution_str, ground_truth, extra_info)`` (called by
  keyword, as verl does; ``ground_truth`` as the row holds it, ``extra_info`` the row's dict);
- AReaL's: ``reward_fn(prompt, completions, prompt_ids, completion_ids, **row)`` (the prompt
  text, the one completion's text, both token id lists, the row's fields by keyword).

It may be ``async def`` and returns a number (a float, int, bool, numpy or torch scalar) or a
dict with a number under ``"reward"`` (verl's ``"score"`` for a verl signature); the dict's
other numeric keys are logged as ``reward/extra/<key>``. Ours is scored against each acceptable
answer of a row that lists several, keeping the best. A path, signature or return value that
is wrong stops the run with one line naming ``reward.fn``, what is wrong and the fix: a reward
that returns the wrong type would otherwise train on zeros without anyone noticing.

Rewards run in worker processes (rewards/runner.py), so what the pool hands them is a value
that names the function, never the function object: a ``reward.fn`` is imported again, by its
path, inside each worker.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple

from ..plugins import PluginError, check_callable, load_object
from ..errors import ConfigError
from .verifiers import REWARDS
from .worker import RewardInput, WrongReturn, as_reward, awaited, best_of, checked_value, wrong_type

RewardFn = Callable[[str, str], float]
PARAMS = ("completion", "target")
VERL = ("data_source", "solution_str", "ground_truth", "extra_info")
AREAL = ("prompt", "completions", "prompt_ids", "completion_ids")
SIGNATURES = {
    "ours": "fn(completion, target)",
    "verl": "compute_score(data_source, solution_str, ground_truth, extra_info)",
    "areal": "reward_fn(prompt, completions, prompt_ids, completion_ids, **row)",
}


def _parameters(fn: Callable) -> Optional[Dict[str, inspect.Parameter]]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None  # a builtin or C callable without a readable signature: taken as ours


def _binds(fn: Callable, params: Dict[str, inspect.Parameter], positional: Tuple[str, ...]) -> Optional[str]:
    """None when ``fn`` can be called with ``positional`` arguments, its later parameters without
    a default filled by name from the row; else why not."""
    row_fields = {n: None for n, p in list(params.items())[len(positional):] if p.default is p.empty
                  and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    try:
        inspect.signature(fn).bind(*positional, **row_fields)
    except TypeError as err:
        return str(err)
    return None


def signature_kind(fn: Callable, spec: str) -> str:
    """``ours`` | ``verl`` | ``areal``: how ``fn`` is called, told by its parameter names (verl's
    data_source, solution_str, ground_truth; AReaL's leading prompt, completions). PluginError,
    one line, when it fits none."""
    params = _parameters(fn)
    if params is None:
        return "ours"
    name = getattr(fn, "__name__", "it")
    if all(key in params for key in VERL[:3]):
        return "verl"
    if list(params)[:2] == list(AREAL[:2]):
        problem = _binds(fn, params, AREAL)
        if problem:
            raise PluginError(f"reward.fn={spec!r}: {name}{inspect.signature(fn)} looks like AReaL's "
                              f"{SIGNATURES['areal']} but cannot be called so ({problem}); give it those four "
                              "parameters and **row")
        return "areal"
    problem = _binds(fn, params, PARAMS)
    if problem:
        raise PluginError(f"reward.fn={spec!r}: {name}{inspect.signature(fn)} cannot be called as {name}(completion, "
                          f"target) ({problem}), nor as verl's {SIGNATURES['verl']} or AReaL's "
                          f"{SIGNATURES['areal']}; give it one of these signatures")
    return "ours"


def _row_kwargs(params: Optional[Dict[str, inspect.Parameter]], row: Dict[str, Any], taken: Tuple[str, ...],
                answer: str) -> Dict[str, Any]:
    """The row's fields a function asks for by keyword: all of them with ``**kwargs``, else those
    it names (after the ones in ``taken``, which the framework fills). ``answer`` is the target
    text when the row has no field of that name (what AReaL's rewards read)."""
    if params is None:
        return {}
    fields = {"answer": answer, **row}
    taken_names = set(taken) | set(list(params)[:len(taken)])
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in fields.items() if k not in taken_names}
    named = [(n, p) for n, p in list(params.items())[len(taken):] if p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    missing = [n for n, p in named if p.default is p.empty and n not in fields]
    if missing:
        raise PluginError(f"its parameter {missing[0]!r} names no field of the dataset row (the row has: "
                          f"{', '.join(sorted(row)) or 'nothing'}); rename it to a field, give it a default, or "
                          "take **row")
    return {n: fields[n] for n, _ in named if n in fields}


class UserReward:
    """``reward.fn``'s function, called the way its signature asks (ours, verl's or AReaL's),
    awaited when it is ``async``, its value checked. Pickles as its import path, loaded where
    it is first called."""

    # The reward pool sends it the prompt, the token ids and the row (RewardInput).
    wants_context = True

    def __init__(self, spec: str, fn: Optional[Callable] = None):
        self.spec = spec
        self._fn = fn
        self._kind: Optional[str] = None

    @property
    def function(self) -> Callable:
        """The user's function, imported and its signature checked (PluginError when it cannot be)."""
        if self._fn is None:
            fn = load_object(self.spec, "reward.fn")
            if not callable(fn):
                check_callable(fn, self.spec, "reward.fn", PARAMS)  # one line: not a function
            self._kind = signature_kind(fn, self.spec)
            self._fn = fn
        elif self._kind is None:
            self._kind = signature_kind(self._fn, self.spec)
        return self._fn

    @property
    def kind(self) -> str:
        """``ours`` | ``verl`` | ``areal``."""
        self.function  # noqa: B018 - loads and tells the signature
        return self._kind

    def __call__(self, completion: str, target: str) -> float:
        return as_reward(self.score_input(RewardInput(completion, (target,))))

    def score_input(self, item: RewardInput) -> Any:
        """The checked return value (a number or a dict with ``reward``) for one completion."""
        fn, kind = self.function, self._kind
        params = _parameters(fn)
        try:
            if kind == "verl":
                extra_info = item.row.get("extra_info")
                args = {"data_source": item.row.get("data_source"), "solution_str": item.completion,
                        "ground_truth": item.target if item.ground_truth is None else item.ground_truth,
                        # A copy: a reward that edits it must not change the next sample's.
                        "extra_info": dict(extra_info) if isinstance(extra_info, dict) else extra_info or {}}
                if params is not None and "extra_info" not in params and not any(
                        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                    del args["extra_info"]
                return checked_value(_verl_value(fn(**args)))
            if kind == "areal":
                row = _row_kwargs(params, item.row, AREAL, item.target)
                return checked_value(fn(item.prompt, item.completion, list(item.prompt_ids),
                                        list(item.completion_ids), **row))
            row = _row_kwargs(params, item.row, PARAMS, item.target)
            return best_of(lambda target: fn(item.completion, target, **row), item.targets)
        except WrongReturn as err:
            raise PluginError(reward_type_message(self.spec, str(err))) from None
        except PluginError as err:  # a parameter the row cannot fill
            raise PluginError(f"reward.fn={self.spec!r}: {err}") from None

    def __reduce__(self):
        return UserReward, (self.spec,)

    def __repr__(self) -> str:
        return f"UserReward({self.spec!r})"


def _verl_value(value: Any) -> Any:
    """verl's dict keeps the score under ``"score"``: the same dict with it under ``"reward"``."""
    value = awaited(value)
    if isinstance(value, dict) and "reward" not in value and "score" in value:
        return {"reward": value["score"], **{k: v for k, v in value.items() if k != "score"}}
    return value


def load_user_reward(spec: str) -> UserReward:
    """The function at import path ``spec``, checked now (PluginError, one line, when it cannot be
    used) and wrapped for the reward pool."""
    reward = UserReward(spec)
    reward.function  # noqa: B018 - imported and checked here, before any worker starts
    return reward


def reward_type_message(spec: str, problem: str) -> str:
    return (f"reward.fn={spec!r} {problem}; return a float (an int, bool, numpy or torch scalar will do) or a dict "
            "with a float 'reward'")


def reward_value(value: Any, spec: str) -> float:
    """The float a user reward returned: the number itself or its dict's ``"reward"``."""
    problem = wrong_type(value)
    if problem is not None:
        raise PluginError(reward_type_message(spec, problem))
    return as_reward(value)  # NaN and inf are the pool's to count, like any failed score


def build_reward(reward_cfg) -> Tuple[RewardFn, str]:
    """``(fn, label)`` for ``reward.fn`` when set, else for ``reward.name``."""
    if reward_cfg.fn:
        return load_user_reward(reward_cfg.fn), f"reward.fn {reward_cfg.fn}"
    return REWARDS[reward_cfg.name], f"reward {reward_cfg.name}"


def check_user_reward(reward_cfg) -> None:
    """reward.fn imports and has a reward's signature: a wrong path or signature is one line before
    anything starts."""
    if not reward_cfg.fn:
        return
    try:
        load_user_reward(reward_cfg.fn)
    except PluginError as err:
        raise ConfigError(str(err)) from None
