"""The prefill benchmark's fused fc1 + SwiGLU candidate (tools/bench/swiglu_matmul.py): its torch
reference is megatron-core's MLP activation (the gate half first), and its kernels compute the
reference, through Triton's interpreter on a CPU (the vLLM test phase's venv has triton) and
compiled on a GPU."""

import sys

import pytest
import torch
from triton_interpreter import ROOT, run_interpreted

sys.path.insert(0, str(ROOT / "tools" / "bench"))

import swiglu_matmul as sm  # noqa: E402 - a benchmark's module, from tools/bench


def test_reference_is_megatrons_mlp(megatron_world, tiny_cfg):
    """fc2(reference(x, fc1.weight)) is megatron-core's MLP forward: the gate is the weight's first
    half (the halves swapped fail this), the activation silu(gate) · up."""
    from megatron.core.transformer.mlp import MLP

    from megatron_rl.models.gpt import build_gpt_model

    torch.manual_seed(0)
    model = build_gpt_model(tiny_cfg.model, 16).cpu().float()
    mlp = next(m for m in model.modules() if type(m) is MLP)
    x = torch.randn(5, 2, tiny_cfg.model.hidden_size)
    with torch.no_grad():
        expected, _ = mlp(x)
        got, _ = mlp.linear_fc2(sm.swiglu_matmul_reference(x, mlp.linear_fc1.weight))
        gate, up = mlp.linear_fc1.weight.chunk(2)
        swapped, _ = mlp.linear_fc2(sm.swiglu_matmul_reference(x, torch.cat([up, gate])))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(swapped, expected, atol=1e-3)


def test_tile_config_round_trips_through_its_text():
    for config in (sm.DEFAULT_CONFIG, sm.TileConfig(64, 32, 128, 4, 4, 2, True)):
        assert sm.TileConfig.parse(str(config)) == config


_INTERPRETED = r"""
import sys
import torch
sys.path.insert(0, "tools/bench")
import swiglu_matmul as sm

gen = torch.Generator().manual_seed(1)
# Rows and columns that leave partial tiles, a hidden size that is not a multiple of the
# reduction block (masked loads), inputs as a strided view; pointer and tensor-descriptor loads;
# fp32 and fp16 (the interpreter's numpy has no bfloat16).
for rows, hidden, ffn, dtype, config, tol in [
        (37, 96, 80, torch.float32, "32x32x64g2w4s2", 1e-5),
        (37, 96, 80, torch.float16, "32x32x32g2w4s2", 2e-3),
        (64, 128, 48, torch.float16, "32x32x32g2w4s2t", 2e-3),
        (33, 64, 40, torch.float32, "16x32x32g4w4s2t", 1e-5)]:
    base = torch.randn(rows, hidden + 8, generator=gen).to(dtype)
    x = base[:, :hidden]
    weight = (torch.randn(2 * ffn, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    got = sm.swiglu_matmul(x, weight, sm.TileConfig.parse(config))
    want = sm.swiglu_matmul_reference(x, weight)
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert got.shape == (rows, ffn) and error <= tol, (rows, hidden, ffn, dtype, config, error)
try:  # rows of 9 fp16 values are not whole 16-byte units: descriptors refuse them
    sm.swiglu_matmul(torch.randn(4, 16).half(), torch.randn(18, 16).half(), sm.TileConfig.parse("16x16x16g1w4s2t"))
    raise AssertionError("expected a ValueError")
except ValueError as exc:
    assert "16-byte" in str(exc)
print("interpreted swiglu matmul ok")
"""


def test_kernel_through_the_interpreter():
    run_interpreted(_INTERPRETED, "interpreted swiglu matmul ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("config", [str(sm.DEFAULT_CONFIG), "256x64x64g8w8s3t"])
def test_kernel_on_a_gpu_is_the_reference_within_a_rounding(config):
    """At a prefill's shape (8,192 tokens of Qwen2-1.5B's MLP, bf16) and with ragged row tiles."""
    for rows in (8192, 1000):
        x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(2 * 8960, 1536, device="cuda", dtype=torch.bfloat16) / 1536 ** 0.5
        got = sm.swiglu_matmul(x, weight, sm.TileConfig.parse(config)).float()
        want = sm.swiglu_matmul_reference(x, weight).float()
        # The gate and up values may round the other way (summation order): a few bf16 units.
        assert ((got - want).abs() <= 2 ** -6 * want.abs() + 2e-2).all(), (got - want).abs().max()
