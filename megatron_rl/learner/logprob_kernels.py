"""Per-token logprob and entropy statistics of the LM head's logits as two Triton kernels (GPU).

The logits of a training micro-batch are the step's largest tensor (16,384 tokens × 151,936
entries in bf16 = 5 GB). What the loss needs per token is four numbers: the max m of logits / T,
the sum of exp(x - m), the sum of exp(x - m)·(x - m) (the entropy's numerator) and the target's
logit. ``row_statistics`` reads each row once with an online softmax (one program per row, the
running max rescales the two sums as it grows); ``logits_gradient`` recomputes each entry's
probability in its backward pass and writes d(loss)/d(logits) in the logits' dtype: one read and
one write of the logits, where the compiled chunk functions (``learner/logprobs.py``) take several
passes and one launch per chunk.

Statistics are per rank's vocabulary slice, each shifted by its own max; under tensor parallelism
``logprobs.py`` rescales them to the group's max before summing (``combine_shards``), so no
separate max pass over the logits is needed.

Used when triton imports and the logits are on a GPU; CI has no GPU, so the kernels run through
Triton's interpreter in the vLLM test phase (tests/test_logprob_kernels.py) and compiled on a GPU.
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from ..models.decode_attention import triton_runs_on

# Entries per block: a row of a 152k vocabulary is 38 blocks of 4,096.
FORWARD_BLOCK = 4096
BACKWARD_BLOCK = 4096
# The running max before a row's first block: finite (so 0 · (m_old - m_new) stays 0), below
# any logit.
_FLOOR = -1.0e30


def available(logits: torch.Tensor) -> bool:
    """Whether the kernels take these logits: on a GPU (or under Triton's interpreter), with
    triton importable."""
    return triton_runs_on(logits)


def row_statistics(logits: torch.Tensor, local_targets: torch.Tensor, in_range: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """[4, N] fp32 per row of ``logits`` [N, V] (x = logits / T): max m, Σ exp(x - m),
    Σ exp(x - m)·(x - m), and x[target] where ``in_range`` (0 elsewhere)."""
    n, width = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(4, n, dtype=torch.float32, device=logits.device)
    if n:
        _kernels()[0][(n,)](logits, logits.stride(0), local_targets, in_range.to(torch.int8), out, n, width, float(temperature),
                            FLOOR=_FLOOR, BLOCK=FORWARD_BLOCK, num_warps=8)
    return out


def logits_gradient(logits: torch.Tensor, local_targets: torch.Tensor, in_range: torch.Tensor,
                    log_norm: torch.Tensor, entropy: torch.Tensor, grad_logprobs: torch.Tensor,
                    grad_entropy: torch.Tensor, temperature: float) -> torch.Tensor:
    """d(loss)/d(logits) [N, V] in the logits' dtype, as ``logprobs.backward_chunk`` computes it:
    with x = logits / T, p = exp(x - log Z):  (-p·(g_H·(log p + H) + g_lp) + [k = target]·g_lp) / T."""
    n, width = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    grad = torch.empty((n, width), dtype=logits.dtype, device=logits.device)
    if n:
        grid = (n, triton_cdiv(width, BACKWARD_BLOCK))
        _kernels()[1][grid](logits, logits.stride(0), grad, grad.stride(0), local_targets, in_range.to(torch.int8),
                            log_norm, entropy, grad_logprobs, grad_entropy, width, float(temperature),
                            BLOCK=BACKWARD_BLOCK, num_warps=8)
    return grad


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def combine_shards(stats: torch.Tensor, group) -> torch.Tensor:
    """The tensor-parallel group's [4, N] statistics from each rank's own (``shift_to`` the
    group's max, then summed; each target lies in one rank's slice)."""
    group_max = stats[0].clone()
    torch.distributed.all_reduce(group_max, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = shift_to(stats, group_max)
    torch.distributed.all_reduce(shifted[1:], group=group)
    return shifted


def shift_to(stats: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """[4, N] statistics shifted by ``new_max`` (≥ their own max m) instead of m: with δ = m - M,
    Σ exp(x - M) = e^δ·s and Σ exp(x - M)·(x - M) = e^δ·(w + δ·s); the target logit unchanged."""
    delta = stats[0] - new_max
    factor = delta.exp()
    return torch.stack((new_max, factor * stats[1], factor * (stats[2] + delta * stats[1]), stats[3]))


def reduce_statistics(stats: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log Z, logprob of the target, entropy) per row from [4, N] statistics."""
    log_sum = stats[1].log()
    log_norm = stats[0] + log_sum
    return log_norm, stats[3] - log_norm, log_sum - stats[2] / stats[1]


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def row_statistics_kernel(Logits, stride_row, Targets, InRange, Out, n_rows, width, temperature,
                              FLOOR: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = Logits + row.to(tl.int64) * stride_row
        cols = tl.arange(0, BLOCK)
        m = tl.full((), FLOOR, tl.float32)
        s = tl.zeros((), tl.float32)
        w = tl.zeros((), tl.float32)
        for start in range(0, width, BLOCK):
            mask = start + cols < width
            x = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32) / temperature
            x = tl.where(mask, x, FLOOR)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            shift = m - m_new
            alpha = tl.exp(shift)
            d = x - m_new
            e = tl.where(mask, tl.exp(d), 0.0)
            w = alpha * (w + shift * s) + tl.sum(e * tl.where(mask, d, 0.0), axis=0)
            s = alpha * s + tl.sum(e, axis=0)
            m = m_new
        target = tl.load(Targets + row)
        hit = tl.load(InRange + row) != 0
        x_t = tl.load(base + target).to(tl.float32) / temperature
        tl.store(Out + row, m)
        tl.store(Out + n_rows + row, s)
        tl.store(Out + 2 * n_rows + row, w)
        tl.store(Out + 3 * n_rows + row, tl.where(hit, x_t, 0.0))

    @triton.jit
    def logits_gradient_kernel(Logits, stride_row, Grad, stride_grad, Targets, InRange, LogNorm, Entropy,
                               GradLogprobs, GradEntropy, width, temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(Logits + row.to(tl.int64) * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        logp = x / temperature - tl.load(LogNorm + row)
        p = tl.exp(logp)
        g_lp = tl.load(GradLogprobs + row)
        g_h = tl.load(GradEntropy + row)
        g = -p * (g_h * (logp + tl.load(Entropy + row)) + g_lp)
        hit = (cols == tl.load(Targets + row)) & (tl.load(InRange + row) != 0)
        g = tl.where(hit, g + g_lp, g) / temperature
        tl.store(Grad + row.to(tl.int64) * stride_grad + cols, g.to(Grad.dtype.element_ty), mask=mask)

    return row_statistics_kernel, logits_gradient_kernel
