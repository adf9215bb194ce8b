"""The rollout engine's RMSNorms as one small Triton kernel each (GPU forwards without autograd).

A decode step at 256 rows runs 57 RMSNorms in Qwen2-1.5B (two per layer and the final one), each
over 256 × 1,536 bf16 activations: under a megabyte in and out, so each launch costs its latency,
not its bytes. torch's fused kernel (``vectorized_layer_norm_kernel``, RMS variant) took 3.3 µs a
launch inside the decode graph on an H100, 0.19 ms of a 4.4 ms step. Here one program normalises
one row: a sum of squares in fp32, then ``x · rsqrt(mean + eps) · weight`` in fp32, rounded once
to the input's dtype, which is torch's arithmetic (the sum's order apart).

``triton_norms_without_grad(model)`` points the engine model's ``torch.nn.RMSNorm`` modules at it
for forwards without autograd on a GPU (the engine's: its model is its own and never trains);
anywhere else, with autograd or where the kernel failed once, torch's forward runs.
``rms_norm_reference`` is the same computation in torch ops: CI has no GPU, so tests compare the
kernel with it through Triton's interpreter (tests/test_rms_norm.py).
"""

from __future__ import annotations

import functools
import logging

import torch

from .decode_attention import triton_runs_on

logger = logging.getLogger(__name__)

# Widest row the kernel takes in one block (Qwen3-30B-A3B's hidden size is 2,048; 8,192 covers
# 70B-class models).
MAX_WIDTH = 16384


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x², last dim) + eps) · weight, in fp32 at least, rounded once to x's dtype."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (wide * rstd * weight.to(wide.dtype)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel: ``rms_norm_reference``'s result (x [..., width], the last dimension
    contiguous; weight [width])."""
    width = x.size(-1)
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton_block(width)
    _kernel()[(rows.size(0),)](rows, weight, out, rows.stride(0), width, float(eps), BLOCK=block,
                               num_warps=max(1, min(8, block // 256)))
    return out.view(x.shape)


def triton_block(width: int) -> int:
    """The kernel's block: the row's width rounded up to a power of two."""
    return 1 << (width - 1).bit_length()


def kernel_applies(x: torch.Tensor, module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward on ``x`` can run the kernel: no autograd, a GPU (or Triton's
    interpreter), an RMSNorm over the last dimension with a weight, not too wide."""
    shape = getattr(module, "normalized_shape", None)
    return (not torch.is_grad_enabled() and triton_runs_on(x) and module.weight is not None
            and shape is not None and len(shape) == 1 and x.size(-1) == shape[0] <= MAX_WIDTH
            and x.dtype == module.weight.dtype)


class _TritonNorm:
    """A torch.nn.RMSNorm's forward through the kernel where ``kernel_applies``."""

    failed = False  # set by the first failure of the kernel: torch's forward from then on

    def __init__(self, module: torch.nn.RMSNorm) -> None:
        self.module = module
        self.default = module.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _TritonNorm.failed or not kernel_applies(x, self.module):
            return self.default(x)
        eps = self.module.eps if self.module.eps is not None else torch.finfo(x.dtype).eps  # torch's default
        try:
            return rms_norm(x, self.module.weight, eps)
        except Exception as exc:  # noqa: BLE001 - a triton failure must not stop generation
            logger.warning("triton RMSNorm failed (%s); using torch's kernel", exc)
            _TritonNorm.failed = True
            return self.default(x)


def triton_norms_without_grad(model: torch.nn.Module) -> int:
    """Point ``model``'s torch.nn.RMSNorm modules at the kernel (see the module's text); returns
    how many."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.forward = _TritonNorm(module)
            changed += 1
    return changed


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(X, W, Out, stride_row, width, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(X + row * stride_row + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(Out + row * width + cols, (x * rstd * w).to(Out.dtype.element_ty), mask=inside)

    return rms_norm_kernel
