"""Make megatron-core 0.16.1 run on CPU with gloo (facts: shared/notes/environment.md).

Megatron assumes CUDA in a few dozen places. Each patch below answers one symptom seen in runs;
all of them are process-wide and applied only when CUDA is absent, never on a GPU machine.
Re-check every one of them on a megatron-core upgrade (tests/test_cpu_patches.py does).
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_lock = threading.Lock()
_thread_local = threading.local()


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps literal ``device="cuda"`` (schedules, causal masks, tensor_parallel/data.py, MoE aux
    loss tracker) to CPU, and makes ``Tensor.cuda()``/``.to("cuda")`` stay on CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


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


def ensure_thread() -> None:
    """Enter the cuda→cpu function mode in the calling thread (torch keeps modes per thread)."""
    if not _applied or getattr(_thread_local, "mode", None) is not None:
        return
    mode = _CudaToCpuMode()
    mode.__enter__()
    _thread_local.mode = mode


def apply_cpu_patches() -> bool:
    """Apply every patch once when CUDA is absent; return whether patches are active."""
    global _applied
    if cuda_available():
        return False
    with _lock:
        if not _applied:
            _patch_process()
            _applied = True
    ensure_thread()
    return True


def patches_active() -> bool:
    return _applied


def _patch_process() -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

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
    # The router calls TransformerEngine's gemm when the name exists.
    moe_utils.te_general_gemm = None

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
