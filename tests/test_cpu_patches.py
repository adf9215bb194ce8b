"""The CPU patches: active without CUDA, per-thread function mode, never applied with CUDA."""

import subprocess
import sys

import pytest
import torch

from megatron_rl.models import cpu_patches

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply only without CUDA")


@cpu_only
def test_active_on_this_cpu_machine(megatron_world):
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules

    assert not torch.cuda.is_available()
    assert cpu_patches.apply_cpu_patches() is True
    assert cpu_patches.patches_active()
    assert torch.cuda.current_device() == "cpu"
    # Literal device="cuda" inside megatron modules builds on CPU ...
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert clip_grads.torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert schedules.torch.Tensor is torch.Tensor and schedules.torch.cuda is torch.cuda
    # ... and tensors asked to move to CUDA stay put.
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.ones(1).to("cuda").device.type == "cpu"
    assert torch.ones(1).to(device="cuda", dtype=torch.float64).dtype == torch.float64
    # bf16 / DistributedOptimizer type check sees a "cuda" tensor type name.
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1).type(torch.float64).dtype == torch.float64


@cpu_only
def test_megatron_modules_imported_later_are_redirected(megatron_world):
    import importlib
    import sys

    name = "megatron.core.transformer.moe.experts"
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    assert module.torch is torch
    cpu_patches.apply_cpu_patches()
    assert module.torch is not torch and module.torch.zeros(1, device="cuda").device.type == "cpu"


@cpu_only
def test_rng_tracker_forks_on_cpu(megatron_world):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the fork restored the default stream
    with get_cuda_rng_tracker().fork():
        assert not torch.equal(torch.rand(3), inside)  # and advanced its own


def test_never_applied_when_cuda_is_available():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "original = torch.cuda.current_device\n"
        "from megatron_rl.models import cpu_patches\n"
        "assert cpu_patches.apply_cpu_patches() is False\n"
        "assert not cpu_patches.patches_active()\n"
        "assert torch.cuda.current_device is original\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
