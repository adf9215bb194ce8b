"""The embedded engine: the learner's Megatron GPTModel, KV-cached, behind RolloutEngine;
in this process or in a child process of its own."""

from .engine import EmbeddedEngine
from .process import EngineProcess

__all__ = ["EmbeddedEngine", "EngineProcess"]
