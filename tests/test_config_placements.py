"""Every config key means the same in every placement, or is refused with one line naming the
placement: the test walks the schema (every leaf key of RootConfig), gives each key a value other
than its default, and checks that one process (``python -m megatron_rl.main``) and a TP=2 torchrun
world (``python -m megatron_rl.launch``) each accept it or refuse it with one ConfigError line; a
value accepted in one placement and refused in the other is refused naming the placement."""

import copy
import dataclasses
from typing import Any, Iterator, List, Tuple

import pytest

from megatron_rl.checks import ALLOWED, ONE_PROCESS, PLACEMENTS, WORLD, allowed, load_config, validate
from megatron_rl.config import ConfigError
from megatron_rl.config.schema import RootConfig


def leaves(obj: Any, prefix: str = "") -> Iterator[Tuple[str, str, Any]]:
    """(dotted key, annotation, default) of every leaf of a config dataclass."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", str(f.type), value


def representative(key: str, annotation: str, default: Any) -> List[Any]:
    """Values other than the default that a user could write for ``key``."""
    if key in ALLOWED:
        return [v for v in allowed(key) if v != default][:2]
    kind = annotation.replace("Optional[", "").rstrip("]")
    if kind == "bool":
        return [not default]
    if kind == "int":
        return [2 if default in (None, 0, 1) else default * 2]
    if kind == "float":
        return [0.5 if default in (None, 0.0) else default / 2]
    if kind == "str":
        return ["other"]
    if kind.startswith("List[int"):
        return [[1, 0]]
    if kind.startswith("List[str"):
        return [["other"]]
    if kind.startswith("Dict"):
        return [{"other": "1"}]
    return []  # List[Dict[...]] (eval.sets): its own tests cover it


CASES = [(key, value) for key, annotation, default in leaves(RootConfig())
         for value in representative(key, annotation, default)]


def _set(cfg: RootConfig, key: str, value: Any) -> RootConfig:
    cfg = copy.deepcopy(cfg)
    *path, name = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, name, value)
    return cfg


def _verdict(cfg: RootConfig, placement: str) -> str:
    """"" when accepted, else the ConfigError's message (any other exception fails the test)."""
    try:
        validate(cfg, placement)
    except ConfigError as err:
        message = str(err)
        assert message and "\n" not in message, f"not one line: {message!r}"
        return message
    return ""


@pytest.fixture(scope="module")
def bases():
    # One process: tiny_cpu. The world: the same at TP=2 (a placement one process cannot hold).
    return {ONE_PROCESS: load_config("tiny_cpu"), WORLD: load_config("tiny_cpu", ["learner.tp=2"], WORLD)}


def test_the_walk_covers_the_schema():
    keys = {key for key, _, _ in leaves(RootConfig())}
    walked = {key for key, _ in CASES}
    assert len(walked) >= len(keys) - 2, sorted(keys - walked)


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_each_key_is_accepted_or_refused_with_one_line_naming_the_placement(bases, key, value):
    verdicts = {placement: _verdict(_set(base, key, value), placement) for placement, base in bases.items()}
    for placement, message in verdicts.items():
        other = WORLD if placement == ONE_PROCESS else ONE_PROCESS
        if message and not verdicts[other]:
            # Refused here only: the line says where it is not available.
            assert PLACEMENTS[placement] in message, f"{key}={value!r} refused {placement} only: {message}"


# The settings that one placement cannot run: each refused there with one line naming it.
ONE_PLACEMENT_ONLY = [
    *[([f"{key}=2"], ONE_PROCESS) for key in ("learner.tp", "learner.pp", "learner.ep", "learner.cp", "learner.dp",
                                              "rollout.tp", "rollout.engines")],
    (["rollout.placement=disaggregated"], ONE_PROCESS),
    (["rollout.device=cuda:1", "rollout.separate_process=true"], WORLD),
    (["rollout.engine=vllm", "rollout.placement=colocated", "rollout.tp=2"], WORLD),
    (["rollout.engine=vllm", "rollout.weight_transport=file"], WORLD),
]


@pytest.mark.parametrize("overrides, placement", ONE_PLACEMENT_ONLY, ids=[" ".join(o) for o, _ in ONE_PLACEMENT_ONLY])
def test_what_one_placement_cannot_run_is_refused_naming_it(overrides, placement):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", overrides, placement)
    assert f"is not available {PLACEMENTS[placement]}: " in str(info.value)
    assert "\n" not in str(info.value)
