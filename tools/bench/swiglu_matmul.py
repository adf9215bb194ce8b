"""The MLP's up projection and SwiGLU as one Triton matmul, as a benchmark candidate.

A SwiGLU MLP's first matmul writes ``[tokens, 2 · ffn]`` (gate and up halves), and the activation
then reads all of it back to write ``silu(gate) · up`` of half the width. At a prefill of 256
prompts of 512 tokens in Qwen2-1.5B that is 4.7 GB written and read again per layer: on an H100
the activation kernel took 63 ms of a 0.59 s prefill, at the card's bandwidth.

Here each program computes one ``[BM, BN]`` tile of the activation's output with two
accumulators: the tile's gate columns and the matching up columns (rows ``n`` and ``ffn + n`` of
megatron-core's fc1 weight, whose local shard stacks the gate half on the up half). The epilogue
rounds both to the output's dtype (as the separate matmul rounds its output), takes
``silu(gate) · up`` in fp32 and rounds once (as megatron-core's compiled SwiGLU does), and writes
only that. Blocks load through pointers or, with ``TileConfig.tma``, tensor descriptors.

``tools/bench/swiglu_matmul_gpu.py`` times it against cuBLAS's matmul plus the activation kernel;
the engine does not use it: on an H100 its Triton matmul ran at 505-543 TFLOP/s where cuBLAS ran
at 600-750, more than the activation's bytes save (docs/benchmarks.md).
``swiglu_matmul_reference`` is the unfused computation in torch ops (tests/test_swiglu_matmul.py
compares the kernel with it through Triton's interpreter).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class TileConfig(NamedTuple):
    """One launch configuration: the output tile (BM rows × BN columns of the activation's
    output), the reduction block, programs grouped along M for L2 reuse, warps, pipeline stages,
    and whether blocks load through tensor descriptors (Hopper's TMA) or pointers."""
    bm: int
    bn: int
    bk: int
    group_m: int
    warps: int
    stages: int
    tma: bool = False

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}g{self.group_m}w{self.warps}s{self.stages}" + ("t" if self.tma else "")

    @classmethod
    def parse(cls, text: str) -> "TileConfig":
        """``BMxBNxBKgGROUPwWARPSsSTAGES[t]`` (``str``'s form), e.g. ``128x128x64g8w8s3t``."""
        tma = text.endswith("t")
        tiles, rest = text.rstrip("t").split("g")
        group, rest = rest.split("w")
        warps, stages = rest.split("s")
        bm, bn, bk = (int(v) for v in tiles.split("x"))
        return cls(bm, bn, bk, int(group), int(warps), int(stages), tma)


# The default launch (the fastest pointer-loading one at 131,072 rows on an H100).
DEFAULT_CONFIG = TileConfig(128, 128, 64, 8, 8, 3)


def swiglu_matmul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) · (x @ up.T)`` with ``weight = [gate; up]`` ([2 · ffn, hidden]): the
    matmul rounded to x's dtype, then the activation in fp32 rounded once."""
    gate, up = torch.chunk(x @ weight.t(), 2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def swiglu_matmul(x: torch.Tensor, weight: torch.Tensor, config: Optional[TileConfig] = None) -> torch.Tensor:
    """The Triton kernel: ``swiglu_matmul_reference``'s result up to the matmul's summation order
    (x [..., hidden] with its last dimension contiguous; weight [2 · ffn, hidden] contiguous), at
    ``config`` (default ``DEFAULT_CONFIG``). Tensor descriptors need rows of whole 16-byte
    units (ffn and hidden multiples of 8 in bf16)."""
    config = config or DEFAULT_CONFIG
    hidden = x.size(-1)
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    ffn = weight.size(0) // 2
    out = torch.empty((rows.size(0), ffn), dtype=x.dtype, device=x.device)
    grid = (triton_cdiv(rows.size(0), config.bm) * triton_cdiv(ffn, config.bn),)
    launch = dict(BM=config.bm, BN=config.bn, BK=config.bk, GROUP_M=config.group_m, num_warps=config.warps,
                  num_stages=config.stages)
    if config.tma:
        if (ffn * x.element_size()) % 16 or (hidden * x.element_size()) % 16:
            raise ValueError(f"tensor descriptors need 16-byte rows: ffn {ffn}, hidden {hidden}")
        from triton.tools.tensor_descriptor import TensorDescriptor

        _tma_kernel()[grid](TensorDescriptor.from_tensor(rows, [config.bm, config.bk]),
                            TensorDescriptor.from_tensor(weight, [config.bn, config.bk]),
                            TensorDescriptor.from_tensor(out, [config.bm, config.bn]),
                            rows.size(0), ffn, hidden, **launch)
    else:
        _kernel()[grid](rows, weight, out, rows.size(0), ffn, hidden, rows.stride(0), weight.stride(0),
                        EVEN_K=hidden % config.bk == 0, **launch)
    return out.view(*x.shape[:-1], ffn)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_matmul_kernel(X, W, Out, M, FFN, K, stride_xm, stride_wn, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
        # Programs in groups of GROUP_M row tiles sweep the columns together: their gate and up
        # blocks stay in L2 across the group.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        tiles_n = tl.cdiv(FFN, BN)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        # Out-of-range rows and columns load row 0 (their results are not stored).
        x_ptrs = X + tl.where(rows < M, rows, 0).to(tl.int64)[:, None] * stride_xm + ks[None, :]
        gate_ptrs = W + tl.where(cols < FFN, cols, 0).to(tl.int64)[None, :] * stride_wn + ks[:, None]
        up_ptrs = gate_ptrs + FFN * stride_wn
        gate = tl.zeros((BM, BN), dtype=tl.float32)
        up = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                x = tl.load(x_ptrs)
                wg = tl.load(gate_ptrs)
                wu = tl.load(up_ptrs)
            else:
                left = K - k * BK
                x = tl.load(x_ptrs, mask=ks[None, :] < left, other=0.0)
                wg = tl.load(gate_ptrs, mask=ks[:, None] < left, other=0.0)
                wu = tl.load(up_ptrs, mask=ks[:, None] < left, other=0.0)
            gate = tl.dot(x, wg, gate)
            up = tl.dot(x, wu, up)
            x_ptrs += BK
            gate_ptrs += BK
            up_ptrs += BK
        # The separate matmul rounds its output; then SwiGLU in fp32, rounded once.
        g = gate.to(Out.dtype.element_ty).to(tl.float32)
        u = up.to(Out.dtype.element_ty).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        out_ptrs = Out + rows.to(tl.int64)[:, None] * FFN + cols[None, :]
        tl.store(out_ptrs, y.to(Out.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < FFN))

    return swiglu_matmul_kernel


@functools.lru_cache(maxsize=1)
def _tma_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_matmul_tma_kernel(x_desc, w_desc, out_desc, M, FFN, K, BM: tl.constexpr, BN: tl.constexpr,
                                 BK: tl.constexpr, GROUP_M: tl.constexpr):
        # As swiglu_matmul_kernel, its blocks loaded by tensor descriptors: reads past an edge
        # are zeros (a gate block past FFN reads up rows, whose columns are not stored), and the
        # store drops what lies outside the output.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        tiles_n = tl.cdiv(FFN, BN)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        m0 = pid_m * BM
        n0 = pid_n * BN
        gate = tl.zeros((BM, BN), dtype=tl.float32)
        up = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            x = x_desc.load([m0, k * BK])
            gate = tl.dot(x, w_desc.load([n0, k * BK]).T, gate)
            up = tl.dot(x, w_desc.load([FFN + n0, k * BK]).T, up)
        g = gate.to(out_desc.dtype).to(tl.float32)
        u = up.to(out_desc.dtype).to(tl.float32)
        out_desc.store([m0, n0], (g * tl.sigmoid(g) * u).to(out_desc.dtype))

    return swiglu_matmul_tma_kernel
