"""The Triton kernels of ``sampling_kernel`` (imported only where they run: triton is optional).

``sample_chunk_kernel``: one program per (row, chunk of ``CHUNK`` entries) folds its entries, four
runs of ``QUARTER`` at a time with one Philox call per lane, into a running max, a sum of
exp(x - max) and the best Gumbel score with its x and id. ``sample_combine_kernel``: one program
per row rescales its chunks' sums to the row's max and picks the best score's token and logprob.
(Kernel names say what they do: a profile lists them by name beside attention's.)
"""

import triton
import triton.language as tl


@triton.jit
def fold_quarter(Base, first, lanes, vocab, inv_temperature, bits, m, s, best, best_x, best_id):
    """Fold the entries first + lanes (x = logits / T, uniforms from the Philox ``bits``) into
    the running max m, sum s of exp(x - m), best score x + G and its x and id."""
    ids = first + lanes
    x = tl.load(Base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
    m_new = tl.maximum(m, tl.max(x, axis=0))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
    # u = 0 gives -inf (never drawn); entries past the row are -inf already.
    scored = x - tl.log(-tl.log(tl.uint_to_uniform_float(bits)))
    block_best = tl.max(scored, axis=0)
    hit = lanes == tl.argmax(scored, axis=0)
    take = block_best > best
    best_x = tl.where(take, tl.sum(tl.where(hit, x, 0.0), axis=0), best_x)
    best_id = tl.where(take, tl.sum(tl.where(hit, ids.to(tl.int64), 0), axis=0), best_id)
    best = tl.where(take, block_best, best)
    return m_new, s, best, best_x, best_id


@triton.jit
def sample_chunk_kernel(Logits, stride_row, Seed, Partial, Ids, vocab, chunks, inv_temperature,
                        FLOOR: tl.constexpr, CHUNK: tl.constexpr, QUARTER: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = Logits + row.to(tl.int64) * stride_row
    seed = tl.load(Seed)
    lanes = tl.arange(0, QUARTER)
    m = tl.full((), FLOOR, tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_x = tl.zeros((), tl.float32)
    best_id = tl.zeros((), tl.int64)
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
    at = row * chunks + chunk
    plane = tl.num_programs(0) * chunks
    tl.store(Partial + at, m)
    tl.store(Partial + plane + at, s)
    tl.store(Partial + 2 * plane + at, best)
    tl.store(Partial + 3 * plane + at, best_x)
    tl.store(Ids + at, best_id)


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
