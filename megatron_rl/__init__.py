"""megatron_rl: a Megatron-centric, asynchronous RL trainer for reasoning and agent LLMs."""

__version__ = "0.1.0"

# Before megatron-core is imported anywhere: its import-time fallback warnings (see _warnings.py).
from ._warnings import quiet_known_warnings as _quiet_known_warnings  # noqa: E402

_quiet_known_warnings()
