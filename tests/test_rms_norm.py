"""The engine's RMSNorm kernel (models/rms_norm.py): its torch reference is torch's RMSNorm, the
kernel computes the reference (through Triton's interpreter on a CPU, compiled on a GPU), and
the engine model's norms take it only for forwards without autograd where it can run."""

import pytest
import torch
from triton_interpreter import run_interpreted

from megatron_rl.models import rms_norm as rn


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reference_is_torchs_rms_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(5, 7, 96, generator=gen)).to(dtype)
    norm = torch.nn.RMSNorm(96, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen).to(dtype) + 0.5)
        expected = norm(x)
    got = rn.rms_norm_reference(x, norm.weight, 1e-6)
    if dtype == torch.float64:
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    else:  # torch rounds once from fp32 as the reference does; the sum's order may differ by a unit
        assert (got.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()


def test_norm_modules_keep_torchs_forward_with_autograd_or_on_a_cpu():
    norm = torch.nn.RMSNorm(16, eps=1e-5)
    model = torch.nn.Sequential(norm)
    assert rn.triton_norms_without_grad(model) == 1
    x = torch.randn(3, 16, requires_grad=True)
    out = norm(x)
    out.sum().backward()  # autograd: torch's forward, gradients flow
    assert x.grad is not None
    with torch.no_grad():  # no GPU and no interpreter: torch's forward too
        assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (16,), norm.weight, 1e-5))
    assert not rn.kernel_applies(x.detach(), norm)


_INTERPRETED = r"""
import torch
from megatron_rl.models import rms_norm as rn

gen = torch.Generator().manual_seed(1)
# A width that is a power of two, one that is not (masked block), rows as a strided view, fp32
# and fp16 (the interpreter's numpy has no bfloat16).
for rows, width, dtype, tol in [(6, 64, torch.float32, 1e-6), (5, 96, torch.float32, 1e-6),
                                (4, 48, torch.float16, 1e-3)]:
    base = torch.randn(rows, width + 8, generator=gen).to(dtype)
    x = base[:, :width]
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    got = rn.rms_norm(x, weight, 1e-6)
    want = rn.rms_norm_reference(x, weight, 1e-6)
    error = (got.float() - want.float()).abs().max().item()
    assert got.shape == x.shape and error <= tol, (rows, width, dtype, error)
# The module path: under no_grad with the interpreter on, the patched norm runs the kernel.
norm = torch.nn.RMSNorm(64, eps=1e-5)
rn.triton_norms_without_grad(norm)
x = torch.randn(3, 2, 64, generator=gen)
with torch.no_grad():
    assert rn.kernel_applies(x, norm)
    assert torch.allclose(norm(x), rn.rms_norm_reference(x, norm.weight, 1e-5), atol=1e-6)
print("interpreted rms norm ok")
"""


def test_kernel_through_the_interpreter():
    run_interpreted(_INTERPRETED, "interpreted rms norm ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernel_on_a_gpu_is_torchs_norm_within_a_rounding():
    """At a decode step's shape (256 × 1,536 bf16) and a prefill's (8,192 rows)."""
    for rows in (256, 8192):
        x = 4 * torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        weight = torch.rand(1536, device="cuda", dtype=torch.bfloat16) + 0.5
        got = rn.rms_norm(x, weight, 1e-6).float()
        want = rn.rms_norm_reference(x, weight, 1e-6).float()
        torchs = torch.nn.functional.rms_norm(x, (1536,), weight, 1e-6).float()
        ulp = 2 ** -7 * want.abs()  # one bf16 rounding step, relative
        assert ((got - want).abs() <= ulp).all() and ((got - torchs).abs() <= ulp).all()


def test_the_engine_model_takes_the_kernel_for_its_norms_and_the_learner_model_does_not(megatron_world, tiny_cfg):
    """build_gpt_model points an engine model's RMSNorms (kv_attention=True) at the kernel, every
    one of them; a learner's model keeps torch's forward."""
    from megatron_rl.models.gpt import build_gpt_model

    def patched(model):
        return [isinstance(m.forward, rn._TritonNorm) for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]

    engine = patched(build_gpt_model(tiny_cfg.model, 16, kv_attention=True))
    learner = patched(build_gpt_model(tiny_cfg.model, 16))
    assert len(engine) == 2 * tiny_cfg.model.num_layers + 1 and all(engine)
    assert len(learner) == len(engine) and not any(learner)
