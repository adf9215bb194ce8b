"""Let two threads of one process run Megatron forwards at once (the embedded engine's compute
thread generating while the learner trains in another).

megatron-core hands every attention call the same scratch tensor from one process-wide
``GlobalMemoryBuffer``; two threads would overwrite each other's attention scores. This gives
each thread its own buffer. Applied on CPU and GPU alike (it changes nothing single-threaded).
"""

from __future__ import annotations

import contextlib
import threading

_local = threading.local()
_installed = False
_lock = threading.Lock()


def _thread_buffer():
    from megatron.core.utils import GlobalMemoryBuffer

    buffer = getattr(_local, "buffer", None)
    if buffer is None:
        buffer = _local.buffer = GlobalMemoryBuffer()
    return buffer


def per_thread_memory_buffers() -> None:
    """Route megatron's get_global_memory_buffer (and the names imported from it) per thread."""
    global _installed
    with _lock:
        if _installed:
            return
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import mappings

        parallel_state.get_global_memory_buffer = _thread_buffer
        mappings.get_global_memory_buffer = _thread_buffer
        _installed = True


_rng_lock = threading.RLock()
_rng_installed = False


def serialize_rng_forks() -> None:
    """Megatron's RNG tracker swaps the process-wide RNG state in and out around dropout
    (``get_cuda_rng_tracker().fork()``) and remembers which state is current; two threads
    forking at once corrupt that bookkeeping. Forks are short, so one lock serialises them."""
    global _rng_installed
    with _lock:
        if _rng_installed:
            return
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        original_fork = CudaRNGStatesTracker.fork

        @contextlib.contextmanager
        def fork(self, *args, **kwargs):
            with _rng_lock, original_fork(self, *args, **kwargs):
                yield

        CudaRNGStatesTracker.fork = fork
        _rng_installed = True


def make_thread_safe() -> None:
    per_thread_memory_buffers()
    serialize_rng_forks()
