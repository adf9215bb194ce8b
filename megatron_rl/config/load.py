"""Hydra glue: register the schema, compose recipes with overrides, convert to dataclasses."""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Dict, List, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from ..errors import ConfigError, nearest, one_line
from .paths import resolve_paths
from .recipes import hydra_search_path, recipe_location, recipe_name
from .schema import RootConfig

SCHEMA_NAME = "megatron_rl_schema"


def register_configs() -> None:
    """Register RootConfig so that recipes can list it in their defaults and get type checking."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RootConfig)


def schema_fields(cls: type = RootConfig, prefix: str = "") -> Dict[str, Any]:
    """Every config key of the schema (``learner.lr``, ...) -> its type; a group's own key too."""
    out: Dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, kind = prefix + f.name, hints[f.name]
        out[key] = kind
        if dataclasses.is_dataclass(kind):
            out.update(schema_fields(kind, key + "."))
    return out


def _type_name(kind: Any) -> str:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    kind = args[0] if typing.get_origin(kind) is typing.Union and len(args) == 1 else kind
    return {int: "an integer", float: "a number", bool: "true or false", str: "text"}.get(
        kind, getattr(kind, "__name__", str(kind)))


def _default(key: str) -> Any:
    obj: Any = RootConfig()
    for part in key.split("."):
        obj = getattr(obj, part)
    return str(obj).lower() if isinstance(obj, bool) else obj


def unknown_key(key: str, where: str) -> ConfigError:
    """The error for a key the schema does not have, with the nearest valid one."""
    fields = schema_fields()
    group, _, name = key.rpartition(".")
    siblings = [k for k in fields if k.rpartition(".")[0] == group]
    if siblings:  # the group exists: the nearest of its own keys
        found = nearest(name, [k.rpartition(".")[2] for k in siblings])
        guess = f"{group}.{found}" if group and found else found
    else:  # the group is misspelled too
        guess = nearest(key, fields)
    hint = f"did you mean {guess}?" if guess else f"the keys of {group or 'the config'} are: " + ", ".join(
        k.rpartition(".")[2] for k in siblings)
    return ConfigError(f"unknown config key {key} ({where}): {hint} "
                       "(every key: python -m megatron_rl.main --print-config)")


def check_overrides(overrides: Sequence[str]) -> None:
    """Command-line overrides name keys of the schema; a misspelled one is a ConfigError naming
    the nearest valid key (Hydra's own message does not say which keys exist)."""
    fields = schema_fields()
    for text in overrides:
        key, sep, _ = text.partition("=")
        key = key.lstrip("+~")
        if not sep and not text.startswith("~"):
            raise ConfigError(f"{text!r} is not an override (command line): write key=value, e.g. trainer.total_steps=50")
        if key.startswith("hydra.") or key in fields:
            continue
        # keys inside a dict- or list-valued field (e.g. model.moe_layer_pattern) are the value's own
        parent = key
        while "." in parent and parent not in fields:
            parent = parent.rpartition(".")[0]
        if parent in fields and not dataclasses.is_dataclass(fields[parent]):
            continue
        raise unknown_key(key, f"command line: {text}")


def _into_dicts(overrides: Sequence[str]) -> List[str]:
    """Overrides of a dict-valued field (``rollout.agent_args``) or of a key inside one, as Hydra's
    add-or-replace (``++``): the schema's empty dict has no keys to override, and Hydra refuses
    new ones without the prefix."""
    fields = schema_fields()
    out = []
    for text in overrides:
        key = text.partition("=")[0]
        parent = key
        while "." in parent and parent not in fields:
            parent = parent.rpartition(".")[0]
        is_dict = parent in fields and typing.get_origin(fields[parent]) in (dict, typing.Dict)
        out.append("++" + text if is_dict and not text.startswith(("+", "~")) else text)
    return out


def _home_expanded(overrides: Sequence[str]) -> List[str]:
    """``data.path=~/data/x`` with the home folder put in: a shell expands ``~`` only after a
    variable name (``recipe=~/x``), not after a dotted key, and Hydra's grammar refuses it."""
    out = []
    for text in overrides:
        key, sep, value = text.partition("=")
        if sep and not key.startswith("~") and (value == "~" or value.startswith("~/")):
            text = f"{key}={os.path.expanduser(value)}"
        out.append(text)
    return out


def to_dataclass(cfg: DictConfig, overrides: Sequence[str] = ()) -> RootConfig:
    """Merge a composed config onto the schema (type-checked), relative paths made absolute. Its
    values are not checked yet: ``megatron_rl.checks.load_config`` resolves and checks them."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), cfg)
        obj = OmegaConf.to_object(merged)
    except (ConfigAttributeError, ConfigKeyError) as err:
        raise unknown_key(str(err.full_key), "the recipe") from None
    except ValidationError as err:
        # A recipe without the schema in its defaults (a run's config.yaml) is type-checked only here.
        text = next((o for o in overrides if o.lstrip("+~").partition("=")[0] == str(err.full_key)), "")
        raise _type_error(str(err.full_key), err.value, f"command line: {text}" if text else "the recipe") from None
    assert isinstance(obj, RootConfig)
    return resolve_paths(obj)


def _type_error(key: str, value: Any, where: str) -> ConfigError:
    kind = schema_fields().get(key)
    if kind is None:
        return ConfigError(f"{key}={value!r} has the wrong type ({where}): see megatron_rl/config/schema.py")
    return ConfigError(f"{key}={value!r} is not {_type_name(kind)} ({where}): give {_type_name(kind)}, "
                       f"e.g. {key}={_default(key)}")


def compose_config(recipe: str = "tiny_cpu", overrides: Sequence[str] = ()) -> RootConfig:
    """Compose the recipe ``recipe`` names (a name in the recipe folders, or a ``.yaml`` file: see
    config/recipes.py) with command-line style overrides, as the CLI does. Relative paths in it
    come out absolute, from the working directory (config/paths.py). Typed, not yet resolved or
    checked: ``megatron_rl.checks.load_config`` is what callers use."""
    from hydra import compose
    from hydra.errors import HydraException, MissingConfigException

    register_configs()
    search_path, config_name = recipe_location(recipe)
    check_overrides(overrides)
    overrides = _into_dicts(_home_expanded(overrides))
    with hydra_search_path(search_path):
        try:
            cfg = compose(config_name=config_name, overrides=list(overrides))
        except (HydraException, MissingConfigException) as err:
            cause = err.__cause__
            if isinstance(cause, ValidationError) and cause.full_key:
                text = next((o for o in overrides if o.lstrip("+~").partition("=")[0] == cause.full_key), "")
                raise _type_error(str(cause.full_key), cause.value, f"command line: {text}" if text else
                                  "command line") from None
            if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
                raise unknown_key(str(cause.full_key), "command line") from None
            raise ConfigError(one_line(err)) from None
    loaded = to_dataclass(cfg, overrides=overrides)
    # Names the default run directory and the trackers' run, for every caller (the CLI did it alone).
    loaded.trainer.recipe = recipe_name(recipe, loaded.trainer.recipe)
    return loaded
