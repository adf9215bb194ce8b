"""megatron_rl: a Megatron-centric, asynchronous RL trainer for reasoning and agent LLMs."""

__version__ = "0.1.0"
