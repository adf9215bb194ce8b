"""The Triton kernels of ``sampling_kernel`` (imported only where they run: triton is optional).

``sample_chunk_kernel``: one program per (row, chunk of ``CHUNK`` entries) folds its entries,
``BLOCK`` lanes at a time, into per-lane running maxima and sums of exp(x - max), x = logits / T,
and reduces the lanes once at the end (a reduction across the block's warps costs a barrier; the
loop has none): the chunk's max and its sum of exp(x - max).

``sample_pick_kernel``: one program per row weighs its chunks by their sums rescaled to the row's
max M (their total S is the softmax's denominator), draws one uniform u from Triton's Philox
stream at (seed, row), finds the chunk where the running sum of the weights passes u · S, then
walks that chunk's entries, exp(x - M) in order, to the entry where it passes: the inverse of the
softmax's cumulative distribution at u. The walk compares sums within one block of entries at a
time (the target less what the blocks before it hold). It writes that token and its logprob x - M - log(S).
(Kernel names say what they do: a profile lists them by name beside attention's.)
"""

import triton
import triton.language as tl


@triton.jit
def sample_chunk_kernel(Logits, stride_row, Partial, vocab, chunks, inv_temperature,
                        FLOOR: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = Logits + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), FLOOR, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        ids = start + lanes
        x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
        # One exponential per entry: the smaller of x and m is rescaled to the larger. x = -inf
        # gives 0 (m is finite: it starts at FLOOR).
        e = tl.exp(-tl.abs(x - m))
        s = tl.where(x > m, s * e + 1.0, s + e)
        m = tl.maximum(m, x)
    top = tl.max(m, axis=0)
    at = row * chunks + chunk
    tl.store(Partial + at, top)
    tl.store(Partial + tl.num_programs(0) * chunks + at, tl.sum(s * tl.exp(m - top), axis=0))


@triton.jit
def sample_pick_kernel(Logits, stride_row, Partial, Seed, Tokens, Logprobs, rows, vocab, chunks, inv_temperature,
                       FLOOR: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = Logits + row.to(tl.int64) * stride_row
    slots = tl.arange(0, CHUNKS)
    inside = slots < chunks
    at = row * chunks + slots
    tops = tl.load(Partial + at, mask=inside, other=FLOOR)
    sums = tl.load(Partial + rows * chunks + at, mask=inside, other=0.0)
    top = tl.max(tops, axis=0)
    weights = sums * tl.exp(tops - top)  # each chunk's share of the row's sum, rescaled to its max
    total = tl.sum(weights, axis=0)
    target = tl.rand(tl.load(Seed), row) * total  # u in [0, 1)
    running = tl.cumsum(weights, axis=0)
    # The first chunk whose running sum passes the target (the last one holding any weight if
    # rounding leaves the target at the end).
    last_chunk = tl.max(tl.where(weights > 0.0, slots, -1), axis=0)
    chunk = tl.minimum(tl.min(tl.where(running > target, slots, CHUNKS), axis=0), last_chunk)
    # The target's offset into that chunk, then into each block: every comparison is of sums
    # within one block, so fp32 rounding moves a boundary by ~2^-24 of the block's sum, not of the
    # row's (a row of 152k similar entries would otherwise shift each entry's share by ~1 %).
    remaining = target - tl.sum(tl.where(slots < chunk, weights, 0.0), axis=0)
    lanes = tl.arange(0, BLOCK)
    choice = vocab + 0  # none yet (an int32 like the ids)
    last = vocab * 0 - 1  # the last entry with any probability: the pick if rounding leaves the target at the end
    for start in range(0, CHUNK, BLOCK):
        ids = chunk * CHUNK + start + lanes
        x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
        p = tl.exp(x - top)
        passed = (tl.cumsum(p, axis=0) > remaining) & (p > 0.0)
        choice = tl.minimum(choice, tl.min(tl.where(passed, ids, vocab), axis=0))
        last = tl.maximum(last, tl.max(tl.where(p > 0.0, ids, -1), axis=0))
        remaining -= tl.sum(p, axis=0)
    token = tl.where(choice < vocab, choice, last)
    x = tl.load(base + token).to(tl.float32) * inv_temperature
    tl.store(Tokens + row, token.to(tl.int64))
    tl.store(Logprobs + row, x - top - tl.log(total))
