"""Two Triton kernels for a decode step's plain sampling (temperature only): token and logprob
in one read of the logits and a short walk of one chunk of them (GPU).

At batch 256 and a 152k vocabulary the logits are 78 MB in bf16. The compiled torch path
(``sampling.draw_tempered``) first writes an fp32 Exp(1) noise tensor twice their size with the
engine's generator, then reads both back: ~0.3 ms of a ~4.1 ms decode step on an H200. A Gumbel-max
kernel that draws the noise itself (one Philox share, two logarithms and an exponential per entry)
still spent 0.17 ms on an H100, bound by that arithmetic, not by the bytes. Here the draw inverts
the softmax's cumulative distribution instead, with one uniform per row:

- the first kernel's programs each take one chunk of one row and keep an online max and sum of
  exp(x - max) of x = logits / T (one exponential per entry, bound by the read);
- the second kernel's program per row rescales its chunks' sums to the row's max M (their total S
  is the softmax's denominator, the logprob x - M - log S), draws u from Triton's counter-based
  Philox generator, finds the chunk where the running sum of the chunks passes u · S, and walks
  that chunk's entries to the one where it passes.

That entry is an exact draw from softmax(x) up to fp32 rounding of the running sums (as
``torch.multinomial``'s own cumulative sums), and -inf entries (probability 0) are never drawn.

The Philox seed is one int64 drawn per call from the engine's ``torch.Generator`` on the device
(no host sync), so a run is reproducible from its seed and the generator's saved state still
decides every draw; the draws differ from the torch path's (other noise, same distribution).
Used when triton imports and the logits are on a GPU (``available``) and the kernels pass a
once-per-device check against torch; CI has no GPU, so they run through Triton's interpreter in
the vLLM test phase (tests/test_sampling_kernel.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Tuple

import torch

from ..models.decode_attention import triton_runs_on

logger = logging.getLogger(__name__)

# Vocabulary entries per program of the first kernel (a 152k row is 38 chunks: 9,728 programs at
# batch 256), which is also how far the second kernel walks; lanes per program.
CHUNK = 4096
BLOCK = 1024
# The running max before a chunk's first entries: finite, below any logit (so exp(m_old - m_new)
# is 0, not NaN, when they are all -inf).
_FLOOR = -1.0e30
# Entry ids are int32.
_MAX_ENTRIES = 2**31 - 1
# False keeps the torch path everywhere (tools/bench/engine_gpu.py --sampler compares the two).
ENABLED = True


def available(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these logits [rows, V]: on a GPU (or under Triton's interpreter),
    with triton importable, few enough entries for int32 Philox offsets, and the kernel checked
    on this device (``agrees_with_torch``)."""
    return (ENABLED and logits.dim() == 2 and logits.numel() <= _MAX_ENTRIES and triton_runs_on(logits)
            and agrees_with_torch(logits.device))


@functools.lru_cache(maxsize=None)
def agrees_with_torch(device: torch.device) -> bool:
    """Whether the kernel, compiled for ``device``, gives torch's logprobs and never draws a
    masked entry (checked once per device: a safeguard for a triton or GPU the tests never ran
    on). If not, or if it fails to compile, a warning says why and sampling keeps the torch path."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = 4 * torch.randn(4, CHUNK + 4 * BLOCK + 3, generator=gen)
    logits[:, ::3] = float("-inf")  # never drawn
    logits[1, :CHUNK] = float("-inf")  # a row whose first chunk holds nothing to draw
    logits = logits.to(device)
    try:
        tokens, logprobs = sample(logits, 0.8, torch.tensor([5], dtype=torch.int64, device=device))
        index = tokens.clamp(0, logits.size(1) - 1)[:, None]  # an id out of range is caught below
        expected = torch.log_softmax(logits.double() / 0.8, dim=-1).gather(-1, index).squeeze(-1)
        gap = float((logprobs.double() - expected).abs().max())
        problem = None
        in_range = bool(((tokens >= 0) & (tokens < logits.size(1))).all())
        if not in_range or not bool(torch.isfinite(logits.gather(-1, index)).all()):
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


def sample(logits: torch.Tensor, temperature: float, seed: torch.Tensor, chunk: int = CHUNK,
           block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token ids [rows] int64, their logprobs under softmax(logits / T) [rows] fp32): one exact
    draw per row of ``logits`` [rows, V] from the Philox stream ``seed`` ([1] int64). ``chunk`` (a
    multiple of ``block``, both powers of two): entries per program of the first kernel; the draws
    depend on neither (u is the row's), up to the running sums' fp32 rounding."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        chunks = -(-vocab // chunk)
        block = min(block, chunk)
        # Per (row, chunk): the max of x = logits / T and the sum of exp(x - max).
        partial = torch.empty(2, rows, chunks, dtype=torch.float32, device=logits.device)
        sample_chunk_kernel, sample_pick_kernel = _kernels()
        inverse = 1.0 / float(temperature)
        sample_chunk_kernel[(rows, chunks)](logits, logits.stride(0), partial, vocab, chunks, inverse, FLOOR=_FLOOR,
                                            CHUNK=chunk, BLOCK=block, num_warps=4)
        sample_pick_kernel[(rows,)](logits, logits.stride(0), partial, seed, tokens, logprobs, rows, vocab, chunks,
                                    inverse, FLOOR=_FLOOR, CHUNK=chunk, CHUNKS=max(2, 1 << (chunks - 1).bit_length()),
                                    BLOCK=block, num_warps=4)
    return tokens, logprobs


def _kernels():
    """(chunk kernel, pick kernel), imported on first use: triton is optional."""
    from . import sampling_triton

    return sampling_triton.sample_chunk_kernel, sampling_triton.sample_pick_kernel
