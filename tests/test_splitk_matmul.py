"""The decode benchmark's split-K matmul candidate (tools/bench/splitk_matmul.py): its kernels
compute the fp32 reference, through Triton's interpreter on a CPU (the vLLM test phase's venv has
triton) and compiled on a GPU."""

import pytest
import torch
from triton_interpreter import ROOT, run_interpreted

_INTERPRETED = r"""
import sys
import torch
sys.path.insert(0, "tools/bench")
from splitk_matmul import SplitConfig, splitk_matmul, splitk_reference

gen = torch.Generator().manual_seed(0)
# Rows and columns that leave partial tiles; a K range the splits cut unevenly (the last split
# shorter, one of them possibly empty); with and without the residual.
# Gated: the input is [gate | up] and the kernel multiplies silu(gate) * up.
for m, n, k, config, residual, gated in [(40, 48, 200, "32x32x32x3x4x1", True, False),
                                         (16, 64, 64, "16x32x16x4x4x1", False, False),
                                         (33, 17, 96, "32x16x32x5x4x1", True, False),
                                         (40, 48, 200, "32x32x32x3x4x1", True, True)]:
    x = torch.randn(m, 2 * k if gated else k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    r = torch.randn(m, n, generator=gen) if residual else None
    got = splitk_matmul(x, w, r, SplitConfig.parse(config), gated=gated)
    want = splitk_reference(x, w, r, gated)
    assert got.shape == (m, n) and (got - want).abs().max() <= 1e-4, (m, n, k, config, (got - want).abs().max())
# The gated reference is SwiGLU's definition.
x = torch.randn(5, 8, generator=gen, dtype=torch.float64)
w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
gate, up = x[:, :4], x[:, 4:]
assert torch.allclose(splitk_reference(x, w, None, True), (gate / (1 + torch.exp(-gate)) * up) @ w.T)
print("interpreted split-K ok")
"""


def test_split_k_kernels_through_the_interpreter():
    run_interpreted(_INTERPRETED, "interpreted split-K ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_split_k_kernels_on_a_gpu():
    import sys

    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    from splitk_matmul import SplitConfig, splitk_matmul, splitk_reference

    x = torch.randn(256, 8960, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 8960, device="cuda", dtype=torch.bfloat16) * 8960 ** -0.5
    r = torch.randn(256, 1536, device="cuda", dtype=torch.bfloat16)
    want = splitk_reference(x, w, r).float()
    got = splitk_matmul(x, w, r, SplitConfig.parse("128x128x64x6x4x4")).float()
    assert (got - want).abs().max() <= 2 ** -7 * want.abs().max()
    fc1_out = torch.randn(256, 2 * 8960, device="cuda", dtype=torch.bfloat16)
    want = splitk_reference(fc1_out, w, r, gated=True).float()
    got = splitk_matmul(fc1_out, w, r, SplitConfig.parse("128x128x64x6x4x4"), gated=True).float()
    assert (got - want).abs().max() <= 2 ** -7 * want.abs().max()
