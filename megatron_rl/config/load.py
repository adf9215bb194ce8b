"""Hydra glue: register the schema, compose recipes with overrides, convert to dataclasses."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from .schema import RootConfig
from .validate import ConfigError, validate

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
SCHEMA_NAME = "megatron_rl_schema"


def register_configs() -> None:
    """Register RootConfig so that recipes can list it in their defaults and get type checking."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RootConfig)


def to_dataclass(cfg: DictConfig, distributed: bool = False) -> RootConfig:
    """Merge a composed config onto the schema (type-checked) and validate its values."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), cfg)
        obj = OmegaConf.to_object(merged)
    except (ConfigAttributeError, ConfigKeyError) as err:
        raise ConfigError(f"unknown config key {err.full_key!r}: check the spelling against "
                          "megatron_rl/config/schema.py") from None
    except ValidationError as err:
        raise ConfigError(f"{err.full_key}: {err.msg.splitlines()[0]}") from None
    assert isinstance(obj, RootConfig)
    from ..models.pretrained import resolve_model_config

    try:  # model.path: the checkpoint's architecture replaces the recipe's model sizes
        obj.model = resolve_model_config(obj.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return validate(obj, distributed=distributed)


def load_config(recipe: str = "tiny_cpu", overrides: Sequence[str] = (), distributed: bool = False) -> RootConfig:
    """Compose ``recipes/<recipe>.yaml`` with command-line style overrides, as the CLI does."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register_configs()
    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
        try:
            cfg = compose(config_name=recipe, overrides=list(overrides))
        except HydraException as err:
            raise ConfigError(str(err).splitlines()[0]) from None
    return to_dataclass(cfg, distributed=distributed)
