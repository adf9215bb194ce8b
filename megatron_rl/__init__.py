"""megatron_rl: a Megatron-centric, asynchronous RL trainer for reasoning and agent LLMs."""

from . import lazy_jit as _lazy_jit

__version__ = "0.1.0"

# Before anything imports megatron-core: its fusion decorators skip importing torch's compiler on
# a CPU-only machine (see lazy_jit.py).
_lazy_jit.install()
# Before megatron-core is imported anywhere: its import-time fallback warnings (see _warnings.py).
from ._warnings import quiet_known_warnings as _quiet_known_warnings  # noqa: E402

_quiet_known_warnings()
