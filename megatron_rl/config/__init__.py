"""Structured configs registered with Hydra's ConfigStore, plus loading and validation."""

from .load import load_config, register_configs, to_dataclass
from .schema import (
    AlgoConfig, DataConfig, LearnerConfig, ModelConfig, RewardConfig, RolloutConfig,
    RootConfig, SchedulerConfig, TrainerConfig,
)
from .validate import ConfigError, validate

__all__ = [
    "AlgoConfig", "ConfigError", "DataConfig", "LearnerConfig", "ModelConfig", "RewardConfig",
    "RolloutConfig", "RootConfig", "SchedulerConfig", "TrainerConfig", "load_config",
    "register_configs", "to_dataclass", "validate",
]
