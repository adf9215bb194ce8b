"""The embedded engine: the learner's Megatron GPTModel, KV-cached, behind RolloutEngine;
in this process or in a child process of its own."""

from .engine import EmbeddedEngine, engine_options

__all__ = ["EmbeddedEngine", "EngineProcess", "engine_options"]


def __getattr__(name: str):
    # Imported on first use: process.py builds on rollout/client.py, which imports this package.
    if name == "EngineProcess":
        from .process import EngineProcess

        return EngineProcess
    raise AttributeError(name)
