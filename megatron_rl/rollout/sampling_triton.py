"""The Triton kernels of ``sampling_kernel`` (imported only where they run: triton is optional).

``sample_chunk_kernel``: one program per (row, chunk of ``CHUNK`` entries) folds its entries, four
runs of ``QUARTER`` at a time with one Philox call per lane, into per-lane running maxima, sums of
exp(x - max) and best Gumbel scores with their x and ids, and reduces the lanes once at the end
(a reduction across the block's warps costs a barrier; the loop has none). ``sample_combine_kernel``:
one program per row rescales its chunks' sums to the row's max and picks the best score's token
and logprob.
(Kernel names say what they do: a profile lists them by name beside attention's.)
"""

import triton
import triton.language as tl


@triton.jit
def fold_quarter(Base, first, lanes, vocab, inv_temperature, bits, m, s, best, best_x, best_id):
    """Fold the entries first + lanes (x = logits / T, uniforms from the Philox ``bits``) into each
    lane's running max m, sum s of exp(x - m), best score x + G and its x and id: element-wise,
    no reduction across lanes (those come once, at the chunk's end)."""
    ids = first + lanes
    x = tl.load(Base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
    # One exponential per entry: the smaller of x and m is rescaled to the larger. x = -inf gives
    # 0 (m is finite: it starts at FLOOR).
    e = tl.exp(-tl.abs(x - m))
    s = tl.where(x > m, s * e + 1.0, s + e)
    m = tl.maximum(m, x)
    # u = 0 gives -inf (never drawn); entries past the row are -inf already.
    scored = x - tl.log(-tl.log(tl.uint_to_uniform_float(bits)))
    take = scored > best
    best = tl.where(take, scored, best)
    best_x = tl.where(take, x, best_x)
    best_id = tl.where(take, ids, best_id)
    return m, s, best, best_x, best_id


@triton.jit
def sample_chunk_kernel(Logits, stride_row, Seed, Partial, Ids, vocab, chunks, inv_temperature,
                        FLOOR: tl.constexpr, CHUNK: tl.constexpr, QUARTER: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = Logits + row.to(tl.int64) * stride_row
    seed = tl.load(Seed)
    lanes = tl.arange(0, QUARTER)
    m = tl.full((QUARTER,), FLOOR, tl.float32)
    s = tl.zeros((QUARTER,), tl.float32)
    best = tl.full((QUARTER,), float("-inf"), tl.float32)
    best_x = tl.zeros((QUARTER,), tl.float32)
    best_id = tl.zeros((QUARTER,), tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, 4 * QUARTER):
        # One Philox call per lane: four uniforms, for the entries start + k * QUARTER + lane.
        u0, u1, u2, u3 = tl.randint4x(seed, row * vocab + start + lanes)
        m, s, best, best_x, best_id = fold_quarter(base, start, lanes, vocab, inv_temperature, u0,
                                                   m, s, best, best_x, best_id)
        m, s, best, best_x, best_id = fold_quarter(base, start + QUARTER, lanes, vocab, inv_temperature, u1,
                                                   m, s, best, best_x, best_id)
        m, s, best, best_x, best_id = fold_quarter(base, start + 2 * QUARTER, lanes, vocab, inv_temperature, u2,
                                                   m, s, best, best_x, best_id)
        m, s, best, best_x, best_id = fold_quarter(base, start + 3 * QUARTER, lanes, vocab, inv_temperature, u3,
                                                   m, s, best, best_x, best_id)
    # The chunk's max, rescaled sum and best score: the lanes reduced once.
    top = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - top), axis=0)
    winner = tl.max(best, axis=0)
    hit = lanes == tl.argmax(best, axis=0)
    at = row * chunks + chunk
    plane = tl.num_programs(0) * chunks
    tl.store(Partial + at, top)
    tl.store(Partial + plane + at, total)
    tl.store(Partial + 2 * plane + at, winner)
    tl.store(Partial + 3 * plane + at, tl.sum(tl.where(hit, best_x, 0.0), axis=0))
    tl.store(Ids + at, tl.sum(tl.where(hit, best_id, 0), axis=0).to(tl.int64))


@triton.jit
def sample_combine_kernel(Partial, Ids, Tokens, Logprobs, rows, chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, CHUNKS)
    inside = lanes < chunks
    at = row * chunks + lanes
    plane = rows * chunks
    m = tl.load(Partial + at, mask=inside, other=float("-inf"))
    s = tl.load(Partial + plane + at, mask=inside, other=0.0)
    best = tl.load(Partial + 2 * plane + at, mask=inside, other=float("-inf"))
    best_x = tl.load(Partial + 3 * plane + at, mask=inside, other=0.0)
    ids = tl.load(Ids + at, mask=inside, other=0)
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(inside, s * tl.exp(m - top), 0.0), axis=0)
    winner = tl.argmax(best, axis=0)
    hit = lanes == winner
    tl.store(Tokens + row, tl.sum(tl.where(hit, ids, 0), axis=0))
    tl.store(Logprobs + row, tl.sum(tl.where(hit, best_x, 0.0), axis=0) - top - tl.log(total))
