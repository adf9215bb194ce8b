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

from splitk_matmul import swiglu_reference  # the split-K candidate's SwiGLU, megatron-core's rounding


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
    return swiglu_reference(x @ weight.t())


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

        _kernels()[1][grid](TensorDescriptor.from_tensor(rows, [config.bm, config.bk]),
                            TensorDescriptor.from_tensor(weight, [config.bn, config.bk]),
                            TensorDescriptor.from_tensor(out, [config.bm, config.bn]),
                            rows.size(0), ffn, hidden, **launch)
    else:
        _kernels()[0][grid](rows, weight, out, rows.size(0), ffn, hidden, rows.stride(0), weight.stride(0),
                        EVEN_K=hidden % config.bk == 0, **launch)
    return out.view(*x.shape[:-1], ffn)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1)
def _kernels():
    """(the pointer-loading kernel, the tensor-descriptor one): swiglu_matmul_triton.py, which
    imports triton (this module does not, so its reference runs where triton is absent)."""
    from swiglu_matmul_triton import swiglu_matmul_kernel, swiglu_matmul_tma_kernel

    return swiglu_matmul_kernel, swiglu_matmul_tma_kernel
