"""Make megatron-core 0.16.1 run on CPU with gloo (facts: shared/notes/environment.md).

Megatron assumes CUDA in a few dozen places. Each patch below answers one symptom seen in runs;
all of them are process-wide and applied only when CUDA is absent, never on a GPU machine.
Re-check every one of them on a megatron-core upgrade (tests/test_cpu_patches.py does).
"""

from __future__ import annotations

import sys
import threading
import types

import torch

_applied = False
_lock = threading.Lock()

# Tensor factories that megatron-core calls with a literal device="cuda".
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
              "randint", "eye", "zeros_like", "ones_like", "empty_like", "full_like")


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _on_cpu(factory):
    def build(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    build.__name__ = getattr(factory, "__name__", "factory")
    return build


class _TorchOnCpu(types.ModuleType):
    """Stands in for the ``torch`` global of megatron-core modules: the same module, except that
    tensor factories asked for device "cuda" (schedules' token counters, causal masks, optimizer
    and grad-clipping buffers, tensor_parallel/data.py, the MoE aux-loss tracker) build on CPU.
    Replacing the module global costs nothing per op, unlike a TorchFunctionMode, which
    intercepted every torch call (measured: most of a tiny_cpu step)."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__.update({name: _on_cpu(getattr(torch, name)) for name in _FACTORIES})

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_ON_CPU = None


def _redirect_megatron_modules() -> int:
    """Point the ``torch`` global of every loaded megatron module at the CPU stand-in."""
    count = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "torch", None) is torch:
            module.torch = _TORCH_ON_CPU
            count += 1
    return count


class _DummyStream:
    """Stands in for torch.cuda.Stream/Event used by the MoE alltoall dispatcher."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _DummyStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, *args) -> float:
        return 0.0


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_cpu_patches() -> bool:
    """Apply every patch once when CUDA is absent; return whether patches are active.

    Safe to call often: each call also redirects megatron modules imported since the last one.
    """
    global _applied, _TORCH_ON_CPU
    if cuda_available():
        return False
    with _lock:
        if not _applied:
            _TORCH_ON_CPU = _TorchOnCpu()
            _patch_process()
            _applied = True
        _redirect_megatron_modules()
    return True


def patches_active() -> bool:
    return _applied


def _import_megatron() -> None:
    """Load the megatron-core modules we use, so that their ``torch`` global can be redirected."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed.finalize_model_grads  # noqa: F401
    import megatron.core.inference.contexts  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    import megatron.core.transformer.moe.moe_layer  # noqa: F401


def _patch_process() -> None:
    _import_megatron()
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # Tensor.cuda()/.to("cuda") stay on CPU (optimizer state loading, a few helpers).
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *a, **k: self

    # RNG tracker: route Megatron's CUDA RNG state helpers to the CPU generator.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all, so go to the generator directly.)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    # ~40 sites build tensors on torch.cuda.current_device().
    torch.cuda.current_device = lambda: "cpu"
    # Pipeline p2p and checkpoint preload synchronise the device.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = _DummyStream
    torch.cuda.Event = _DummyStream
    torch.cuda.current_stream = lambda *a, **k: _DummyStream()
    torch.cuda.stream = lambda *a, **k: _DummyStream()

    # Alltoall split sizes must be python/numpy values for gloo's all_to_all_single.
    original_move = moe_utils.maybe_move_tensor_to_cpu

    def move_to_host(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original_move(tensor, *args, **kwargs)

    moe_utils.maybe_move_tensor_to_cpu = move_to_host
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host

    # bf16 / DistributedOptimizer check that params are torch.cuda.*Tensor via Tensor.type().
    original_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            if self.device.type == "cpu" and not name.startswith("torch.cuda."):
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type
