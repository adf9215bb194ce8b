"""The embedded engine: the learner's Megatron GPTModel, KV-cached, behind RolloutEngine."""

from .engine import EmbeddedEngine

__all__ = ["EmbeddedEngine"]
