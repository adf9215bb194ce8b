"""Structured configs registered with Hydra's ConfigStore, composing recipes, and the config's own
value checks. Resolving and checking a whole config (every owner's keys) is ``megatron_rl.checks``,
above the packages that own the keys: ``from megatron_rl.checks import load_config``."""

from ..errors import ConfigError
from .load import compose_config, register_configs, to_dataclass
from .schema import (
    AlgoConfig, DataConfig, LearnerConfig, ModelConfig, RewardConfig, RolloutConfig,
    RootConfig, SchedulerConfig, TrainerConfig,
)

__all__ = [
    "AlgoConfig", "ConfigError", "DataConfig", "LearnerConfig", "ModelConfig", "RewardConfig",
    "RolloutConfig", "RootConfig", "SchedulerConfig", "TrainerConfig", "compose_config",
    "register_configs", "to_dataclass",
]
