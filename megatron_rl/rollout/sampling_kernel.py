"""One Triton kernel for a decode step's plain sampling (temperature only): token and logprob in
one read of the logits (GPU).

At batch 256 and a 152k vocabulary the logits are 78 MB in bf16. The compiled torch path
(``sampling.draw_tempered``) first writes an fp32 Exp(1) noise tensor twice their size with the
engine's generator, then reads both back: ~0.3 ms of a ~4.2 ms decode step on an H200, several
times what one read of the logits costs at the card's bandwidth. Here each program takes one row
and, block by block, keeps an online log-sum-exp of x = logits / T (for the logprob) and the
running Gumbel-max argmax(x + G), G = -log(-log(u)), with u drawn in the kernel by Triton's
counter-based Philox generator: argmax(x + G) is an exact draw from softmax(x), as the exponential
race of ``torch.multinomial`` is; no noise tensor exists.

The Philox seed is one int64 drawn per call from the engine's ``torch.Generator`` on the device
(no host sync), so a run is reproducible from its seed and the generator's saved state still
decides every draw; the draws differ from the torch path's (other noise, same distribution).
Used when triton imports and the logits are on a GPU (``available``); CI has no GPU, so the
kernel runs through Triton's interpreter in the vLLM test phase (tests/test_sampling_kernel.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Tuple

import torch

from ..models.decode_attention import triton_runs_on

logger = logging.getLogger(__name__)

# Vocabulary entries per block: a 152k row is 38 blocks.
BLOCK = 4096
# The running max before a row's first block: finite, below any logit (so exp(m_old - m_new)
# is 0, not NaN, when the first block holds only -inf).
_FLOOR = -1.0e30
# Philox offsets are row * vocab + column in int32.
_MAX_ENTRIES = 2**31 - 1


def available(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these logits [rows, V]: on a GPU (or under Triton's interpreter),
    with triton importable, few enough entries for int32 Philox offsets, and the kernel checked
    on this device (``agrees_with_torch``)."""
    return (logits.dim() == 2 and logits.numel() <= _MAX_ENTRIES and triton_runs_on(logits)
            and agrees_with_torch(logits.device))


@functools.lru_cache(maxsize=None)
def agrees_with_torch(device: torch.device) -> bool:
    """Whether the kernel, compiled for ``device``, gives torch's logprobs and never draws a
    masked entry (checked once per device: a safeguard for a triton or GPU the tests never ran
    on). If not, or if it fails to compile, a warning says why and sampling keeps the torch path."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = 4 * torch.randn(4, 2 * BLOCK + 3, generator=gen)
    logits[:, ::3] = float("-inf")  # never drawn
    logits[1, :BLOCK] = float("-inf")  # a row whose first block holds nothing to draw
    logits = logits.to(device)
    try:
        tokens, logprobs = sample(logits, 0.8, torch.tensor([5], dtype=torch.int64, device=device))
        expected = torch.log_softmax(logits.double() / 0.8, dim=-1).gather(-1, tokens[:, None].clamp(0, logits.size(1) - 1))
        gap = float((logprobs.double() - expected.squeeze(-1)).abs().max())
        drawn = logits.gather(-1, tokens[:, None].clamp(0, logits.size(1) - 1))
        problem = None
        if not bool(((tokens >= 0) & (tokens < logits.size(1))).all()) or not bool(torch.isfinite(drawn).all()):
            problem = f"drew an entry it must not: {tokens.tolist()}"
        elif not gap <= 1e-4:
            problem = f"logprobs off by {gap:.2e}"
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile here
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        logger.warning("the fused sampling kernel fails its check on %s (%s): sampling keeps the torch path",
                       device, problem)
        return False
    return True


def draw_seed(generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """One Philox seed ([1] int64, on ``device``) from ``generator``: a device-side draw, no sync."""
    return torch.randint(0, 2**62, (1,), generator=generator, device=device, dtype=torch.int64)


def sample(logits: torch.Tensor, temperature: float, seed: torch.Tensor,
           block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token ids [rows] int64, their logprobs under softmax(logits / T) [rows] fp32): one exact
    draw per row of ``logits`` [rows, V] from the Philox stream ``seed`` ([1] int64). ``block``
    (a power of two): entries per step of a row's loop; the draws do not depend on it."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _kernel()[(rows,)](logits, logits.stride(0), seed, tokens, logprobs, vocab, 1.0 / float(temperature),
                           FLOOR=_FLOOR, BLOCK=block, num_warps=8)
    return tokens, logprobs


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sample_kernel(Logits, stride_row, Seed, Tokens, Logprobs, vocab, inv_temperature,
                      FLOOR: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = Logits + row.to(tl.int64) * stride_row
        seed = tl.load(Seed)
        cols = tl.arange(0, BLOCK)
        m = tl.full((), FLOOR, tl.float32)      # running max of x
        s = tl.zeros((), tl.float32)            # running sum of exp(x - m)
        best = tl.full((), float("-inf"), tl.float32)  # best x + G so far
        best_x = tl.zeros((), tl.float32)       # its x
        best_id = tl.zeros((), tl.int64)        # its vocabulary id
        for start in range(0, vocab, BLOCK):
            ids = start + cols
            inside = ids < vocab
            x = tl.load(base + ids, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
            u = tl.rand(seed, row * vocab + ids)
            # u = 0 gives -inf (never drawn); entries past the row are -inf already.
            scored = x - tl.log(-tl.log(u))
            block_best = tl.max(scored, axis=0)
            at = tl.argmax(scored, axis=0)
            block_x = tl.sum(tl.where(cols == at, x, 0.0), axis=0)
            take = block_best > best
            best_id = tl.where(take, (start + at).to(tl.int64), best_id)
            best_x = tl.where(take, block_x, best_x)
            best = tl.where(take, block_best, best)
        tl.store(Tokens + row, best_id)
        tl.store(Logprobs + row, best_x - m - tl.log(s))

    return sample_kernel
