"""A split-K matmul for the decode step's small projections, as a benchmark candidate.

At 256 rows a projection to 1,536 features has 24 output tiles of 128 × 128 for 132 streaming
multiprocessors: cuBLAS leaves the down projection at ~45 % of its bound and the output
projection at ~23 % (docs/benchmarks.md). Here each output tile's K range is cut into ``split``
pieces, one program each, which write fp32 partial sums; a second kernel adds them in a fixed
order (so the result does not depend on which program finishes first), adds the residual and
rounds once. ``gated``: the input is the gate and up projections side by side ([M, 2K], as
megatron-core's fc1 writes them) and the kernel loads SwiGLU's product, silu(gate) · up rounded
to the input's dtype as megatron-core's fused SwiGLU rounds it, so the down projection needs no
activation kernel and no intermediate in memory. ``tools/bench/decode_gemm_gpu.py --splitk``
times it against cuBLAS; the engine does not use it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch


class SplitConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int

    @classmethod
    def parse(cls, spec: str) -> "SplitConfig":
        """``BMxBNxBKxSPLITxWARPSxSTAGES``, e.g. ``128x128x64x6x4x4``."""
        return cls(*(int(v) for v in spec.split("x")))

    def __str__(self) -> str:
        return "x".join(str(v) for v in self)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of x = [gate | up], in fp32, rounded once to x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def splitk_reference(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None,
                     gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ residual [M, N]) in fp32, rounded once to x's dtype; with
    ``gated``, x is [M, 2K] and swiglu_reference(x) is multiplied."""
    if gated:
        x = swiglu_reference(x)
    out = x.float() @ weight.float().t()
    if residual is not None:
        out = out + residual.float()
    return out.to(x.dtype)


def splitk_matmul(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor], config: SplitConfig,
                  workspace: Optional[torch.Tensor] = None, gated: bool = False) -> torch.Tensor:
    """``splitk_reference``'s result from the two kernels. ``workspace``: fp32, at least
    split × M × N elements (made here when None; a CUDA graph should pass its own)."""
    m, k = x.shape
    k = k // 2 if gated else k
    assert weight.size(1) == k, f"weight {tuple(weight.shape)} for an input of {k} features"
    n = weight.size(0)
    per_split = -(-k // config.split)
    per_split = -(-per_split // config.block_k) * config.block_k  # whole K blocks per program
    if workspace is None:
        workspace = torch.empty(config.split * m * n, dtype=torch.float32, device=x.device)
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    # Whole tiles and K blocks everywhere: loads without masks, which Triton can vectorize.
    even = m % config.block_m == 0 and n % config.block_n == 0 and k % config.block_k == 0
    _partial_kernel()[(tiles, config.split)](
        x, weight, workspace, m, n, k, per_split, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        BM=config.block_m, BN=config.block_n, BK=config.block_k, GATED=gated, EVEN=even, num_warps=config.warps,
        num_stages=config.stages)
    return reduce_partials(workspace, residual, config.split, m, n, x.dtype)


def reduce_partials(partials: torch.Tensor, residual: Optional[torch.Tensor], split: int, m: int, n: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The [m, n] result of ``split`` fp32 partial sums laid out one after another in
    ``partials``: added in a fixed order, plus the residual, rounded once to ``dtype``."""
    out = torch.empty((m, n), dtype=dtype, device=partials.device)
    block = 1024
    _reduce_kernel()[(-(-m * n // block),)](
        partials, residual if residual is not None else out, out, m * n, SPLIT=split,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=4)
    return out


def bmm_splitk_matmul(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor], split: int,
                      gated: bool = False) -> torch.Tensor:
    """``splitk_reference``'s result with cuBLAS computing the partial sums: x's and the weight's
    K range cut into ``split`` equal pieces as strided views, one batched matmul into fp32
    partials (``bmm``'s ``out_dtype``, CUDA only), then the reduce kernel. ``gated``: megatron's
    SwiGLU product is formed first, as its own kernel."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    m, k = x.shape
    n = weight.size(0)
    assert k % split == 0, f"{k} features do not cut into {split} equal pieces"
    pieces = k // split
    partials = torch.bmm(x.view(m, split, pieces).transpose(0, 1), weight.view(n, split, pieces).permute(1, 2, 0),
                         out_dtype=torch.float32)
    return reduce_partials(partials, residual, split, m, n, x.dtype)


@functools.lru_cache(maxsize=1)
def _partial_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitk_partial_kernel(X, W, Work, M, N, K, per_split, sxm, sxk, swn, swk,
                              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr,
                              EVEN: tl.constexpr):
        tile = tl.program_id(0)
        split = tl.program_id(1)
        tiles_n = tl.cdiv(N, BN)
        rows = (tile // tiles_n) * BM + tl.arange(0, BM)
        cols = (tile % tiles_n) * BN + tl.arange(0, BN)
        inner = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        start = split * per_split
        end = tl.minimum(start + per_split, K)
        for k in range(start, end, BK):
            ks = tl.max_contiguous(tl.multiple_of(k + inner, BK), BK)
            a_mask = (rows[:, None] < M) & (ks[None, :] < end)
            b_mask = (cols[None, :] < N) & (ks[:, None] < end)
            if EVEN:
                a = tl.load(X + rows[:, None] * sxm + ks[None, :] * sxk)
                b = tl.load(W + cols[None, :] * swn + ks[:, None] * swk)
            else:
                a = tl.load(X + rows[:, None] * sxm + ks[None, :] * sxk, mask=a_mask, other=0.0)
                b = tl.load(W + cols[None, :] * swn + ks[:, None] * swk, mask=b_mask, other=0.0)
            if GATED:  # a is the gate; the up projection sits K columns further
                if EVEN:
                    up = tl.load(X + rows[:, None] * sxm + (ks[None, :] + K) * sxk)
                else:
                    up = tl.load(X + rows[:, None] * sxm + (ks[None, :] + K) * sxk, mask=a_mask, other=0.0)
                gate = a.to(tl.float32)
                a = (gate * tl.sigmoid(gate) * up.to(tl.float32)).to(X.dtype.element_ty)
            acc = tl.dot(a, b, acc)
        offsets = split.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(Work + offsets, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))

    return splitk_partial_kernel


@functools.lru_cache(maxsize=1)
def _reduce_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitk_reduce_kernel(Work, Residual, Out, MN, SPLIT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                             BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offsets < MN
        acc = tl.load(Work + offsets, mask=live, other=0.0)
        for s in tl.static_range(1, SPLIT):  # in split order: the same sum whichever program ended last
            acc += tl.load(Work + s * MN + offsets, mask=live, other=0.0)
        if HAS_RESIDUAL:
            acc += tl.load(Residual + offsets, mask=live, other=0.0).to(tl.float32)
        tl.store(Out + offsets, acc.to(Out.dtype.element_ty), mask=live)

    return splitk_reduce_kernel
