"""A decode step's attention on a GPU as one split-key Triton kernel (flash decoding, grouped queries).

One new token per row attends over the row's cached keys. The work is reading the cache: at
batch 256 with 768 slots, Qwen2-1.5B's 28 layers read 5.6 GB of keys and values per step. torch's
fused kernel (cuDNN on an H200) reads them at about 2.7 TB/s of the chip's ~4.3 (measured
1.9 ms per step), and it reads every slot of the step's static width, the masked ones too.

Here each program takes one (row, key group, slice of the slots): the group's query heads are the
rows of one small matrix product against each block of keys (no copy of the keys per head), the
softmax is kept online, and only the blocks from the slice's first seen slot to its last are read
(left padding and the slots after the new token within the static width are not), in a loop
without branches so that Triton pipelines the key and value loads. A second kernel
combines the slices' partial results. Slicing the slots gives the GPU enough programs at small
batches too; where the rows alone give enough (one slice), the kernel writes the output itself and
the combining launch and its partial results are skipped.

Used when triton imports (it ships with CUDA builds of torch); ``CachedKVAttention.decode_kernel``
selects it. CI has no GPU: ``split_decode_reference`` computes the same slicing and combination
with torch ops on any device, and tests compare it with plain attention; the Triton kernels
themselves run through Triton's interpreter on a CPU (in the vLLM test phase, whose venv has
triton) and compiled on a GPU (tests/test_decode_attention.py).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional, Tuple

import torch

BLOCK_SLOTS = 64  # slots per block of keys (one matrix product per block)
# The split kernel's launch: warps per program and software-pipelined loads of key/value blocks
# (tools/bench/decode_attention_gpu.py --configs compares choices).
SPLIT_WARPS = 4
SPLIT_STAGES = 2
# Programs the slicing aims for: about four per streaming multiprocessor (132 on an H200), so that
# loads overlap. 512, not 4 x 132: 256 rows of 2 key groups (512 programs) then keep one slice,
# which on an H200 took 1.20 ms per 28-layer step at 640 slots where two slices and their combine
# took 1.38 (tools/bench/decode_attention_gpu.py --configs 64x4x2,64x4x2x512).
TARGET_PROGRAMS = 512


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """Whether triton imports here (with or without a GPU: its interpreter runs on a CPU)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: torch's kernels run instead
        return False
    return True


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``tensor``: triton imports and the tensor is on a GPU, or
    Triton's interpreter is on (TRITON_INTERPRET=1: how CI, which has no GPU, runs the kernels)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (tensor.is_cuda or interpreted) and triton_importable()


def triton_available() -> bool:
    """Whether the Triton kernels can run compiled: triton imports and there is a GPU."""
    return triton_importable() and torch.cuda.is_available()


def supports(head_dim: int, per_group: int) -> bool:
    """Shapes the kernels take: a head dimension that is a power of two from 16 to 256 (Triton's
    block shapes), at most 128 query heads per key group."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and per_group <= 128


class NewSlot(NamedTuple):
    """A static decode step's new token, for the kernel to rotate and store before it attends
    (``decode_attention``'s ``new``): its key and value [rows, groups, dim] (views, the last
    dimension contiguous), RoPE's cos and sin [dim] at its position, and its cache slot ([1] int64
    on the device)."""
    key: torch.Tensor
    value: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot: torch.Tensor


def split_plan(rows: int, groups: int, slots: int) -> Tuple[int, int]:
    """(slices, slots per slice): enough programs for the GPU, each slice a whole number of blocks."""
    blocks = -(-slots // BLOCK_SLOTS)
    slices = max(1, min(blocks, -(-TARGET_PROGRAMS // (rows * groups))))
    per_slice = -(-blocks // slices) * BLOCK_SLOTS
    return -(-slots // per_slice), per_slice


def split_decode_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """What the Triton kernels compute, with torch ops: query [b, g, r, d], key and value
    [b, g, slots, d], bias [b, 1, 1, slots] (0 seen, -inf masked) -> [b, g, r, d]. Each slice of
    slots gives (max score, sum of exp, weighted values); the slices are combined exactly."""
    b, g, r, d = query.shape
    slots = key.size(2)
    _, per_slice = split_plan(b, g, slots)
    maxes, sums, accs = [], [], []
    for start in range(0, slots, per_slice):
        part = slice(start, start + per_slice)
        scores = torch.matmul(query.float(), key[:, :, part].float().transpose(-1, -2)) * scale
        scores = scores + bias[..., part].float()
        m = scores.amax(dim=-1, keepdim=True)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a wholly masked slice adds nothing
        p = torch.exp(scores - m_safe)
        maxes.append(m)
        sums.append(p.sum(dim=-1, keepdim=True))
        accs.append(torch.matmul(p.to(value.dtype).float(), value[:, :, part].float()))
    top = torch.stack(maxes).amax(dim=0)
    weights = [torch.exp(m - top) for m in maxes]  # exp(-inf) = 0
    numerator = sum(w * a for w, a in zip(weights, accs))
    denominator = sum(w * s for w, s in zip(weights, sums))
    return (numerator / denominator).to(query.dtype)


def scan_block(per_slice: int) -> int:
    """Bias entries the kernel reads at once to find a slice's seen slots: the slice rounded up to
    a power of two (one load for a decode step's slice), at most 4,096 (a loop beyond)."""
    return min(max(BLOCK_SLOTS, 1 << (per_slice - 1).bit_length()), 4096)


def rotates_in_kernel(rows: int, groups: int, slots: int) -> bool:
    """Whether ``decode_attention`` can take a ``NewSlot`` at this shape: one slice per (row, key
    group), so the program that stores a row's new key is the only one reading that row's cache."""
    return split_plan(rows, groups, slots)[0] == 1


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                     scale: float, new: Optional[NewSlot] = None) -> torch.Tensor:
    """The Triton kernels (shapes as in ``split_decode_reference``; key and value may be views with
    any batch and group strides, the last dimension contiguous). With ``new`` (where
    ``rotates_in_kernel``): the query comes unrotated (any strides, the last dimension
    contiguous, e.g. a view of the fused QKV projection) and each program first does what
    models/rope_store.py's ``rope_store`` does for its row and group (the query heads and the new
    key rotated in fp32 and rounded once, the key and value stored at the slot of ``key`` and
    ``value``'s cache), then attends: the same result, one launch fewer per layer."""
    kernels = _kernels()
    b, g, r, d = query.shape
    slots = key.size(2)
    slices, per_slice = split_plan(b, g, slots)
    if new is None:
        query = query.contiguous()
    else:
        assert slices == 1, "a NewSlot needs one slice per (row, key group): see rotates_in_kernel"
        assert query.stride(3) == 1 and new.key.stride(2) == 1 and new.value.stride(2) == 1
    bias = bias.reshape(b, slots)
    if bias.stride(1) != 1:
        bias = bias.contiguous()
    r_pad = max(16, 1 << (r - 1).bit_length())
    out = torch.empty((b, g, r, d), dtype=query.dtype, device=query.device)
    if slices == 1:  # the split kernel normalises and writes ``out``; the partial buffers go unused
        part_max = part_sum = part_acc = out
    else:
        part_max = torch.empty(b * g, slices, r_pad, device=query.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(b * g, slices, r_pad, d, device=query.device, dtype=torch.float32)
    kernels.split(
        (b * g, slices),
        query, key, value, bias, part_max, part_sum, part_acc, out,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        bias.stride(0), g, slots, per_slice, scale,
        *(new if new is not None else (query,) * 5),  # unread without ROPE
        *((new.key.stride(0), new.key.stride(1), new.value.stride(0), new.value.stride(1)) if new is not None
          else (0, 0, 0, 0)),
        R=r, R_PAD=r_pad, D=d, BLOCK_N=BLOCK_SLOTS, SLICES=slices, ROPE=new is not None, SCAN=scan_block(per_slice),
    )
    if slices > 1:
        kernels.combine((b * g,), part_max, part_sum, part_acc, out, R=r, R_PAD=r_pad, D=d, SLICES=slices)
    return out


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_split_kernel(Q, K, V, Bias, PartMax, PartSum, PartAcc, Out,
                               sqb, sqg, sqr, skb, skg, sks, svb, svg, svs, sbb,
                               G, slots, per_slice, scale,
                               NewK, NewV, Cos, Sin, Slot, snkb, snkg, snvb, snvg,
                               R: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                               SLICES: tl.constexpr, ROPE: tl.constexpr, SCAN: tl.constexpr):
        bg = tl.program_id(0)
        part = tl.program_id(1)
        b = bg // G
        g = bg % G
        offs_r = tl.arange(0, R_PAD)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        q_at = Q + b * sqb + g * sqg + offs_r[:, None] * sqr
        q = tl.load(q_at + offs_d[None, :], mask=offs_r[:, None] < R, other=0.0)
        k_base = K + b.to(tl.int64) * skb + g * skg
        v_base = V + b.to(tl.int64) * svb + g * svg
        if ROPE:
            # rope_store's rotation, t * cos + rotate_half(t) * sin over whole heads, written as
            # its two halves are (x_lo * cos - x_hi * sin, x_hi * cos + x_lo * sin): the same
            # fp32 arithmetic, rounded once, so the rotated query and key are rope_store's bits.
            half = D // 2
            partner = (offs_d + half) % D
            low = offs_d < half
            cos = tl.load(Cos + offs_d).to(tl.float32)
            sin = tl.load(Sin + offs_d).to(tl.float32)
            qf = q.to(tl.float32)
            qp = tl.load(q_at + partner[None, :], mask=offs_r[:, None] < R, other=0.0).to(tl.float32)
            q = tl.where(low[None, :], qf * cos[None, :] - qp * sin[None, :],
                         qf * cos[None, :] + qp * sin[None, :]).to(Q.dtype.element_ty)
            k_at = NewK + b * snkb + g * snkg
            kf = tl.load(k_at + offs_d).to(tl.float32)
            kp = tl.load(k_at + partner).to(tl.float32)
            k_new = tl.where(low, kf * cos - kp * sin, kf * cos + kp * sin)
            slot = tl.load(Slot)
            tl.store(k_base + slot * sks + offs_d, k_new.to(K.dtype.element_ty))
            tl.store(v_base + slot * svs + offs_d, tl.load(NewV + b * snvb + g * snvg + offs_d))
            tl.debug_barrier()  # the stores above are read back by the loop below (other threads)
        m = tl.full([R_PAD], float("-inf"), tl.float32)
        s_sum = tl.zeros([R_PAD], tl.float32)
        acc = tl.zeros([R_PAD, D], tl.float32)
        start = part * per_slice
        end = tl.minimum(start + per_slice, slots)
        # The slice's seen slots first (bias not -inf): the blocks before the first and after the
        # last are never read (left padding, and the slots after the new token in a static
        # step's width). The loop below then has no branch, so its key and value loads are
        # software-pipelined (num_stages): a load inside a data-dependent branch is not, and the
        # program would wait on each block's keys and then its values in turn.
        offs_scan = tl.arange(0, SCAN)
        lo = end
        hi = start
        for c0 in range(start, end, SCAN):
            n = c0 + offs_scan
            seen = tl.load(Bias + b * sbb + n, mask=n < end, other=float("-inf")) > float("-inf")
            lo = tl.minimum(lo, tl.min(tl.where(seen, n, end), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(seen, n + 1, start), axis=0))
        first = start + (lo - start) // BLOCK_N * BLOCK_N  # the block holding the first seen slot
        for n0 in range(first, hi, BLOCK_N):
            n = n0 + offs_n
            inside = n < end
            bias = tl.load(Bias + b * sbb + n, mask=inside, other=float("-inf")).to(tl.float32)
            k = tl.load(k_base + n[:, None] * sks + offs_d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_base + n[:, None] * svs + offs_d[None, :], mask=inside[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale + bias[None, :]
            # The first block holds a seen slot, so m_new is finite from it on (m = -inf before
            # it: alpha 0); a wholly masked block later (a hole) adds exp(-inf) = 0.
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            s_sum = s_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if SLICES == 1:  # the whole row seen here: normalise and write it (no combining launch)
            tl.store(Out + (bg * R + offs_r[:, None]) * D + offs_d[None, :],
                     (acc / s_sum[:, None]).to(Out.dtype.element_ty), mask=offs_r[:, None] < R)
        else:
            out = bg * SLICES + part
            tl.store(PartMax + out * R_PAD + offs_r, m)
            tl.store(PartSum + out * R_PAD + offs_r, s_sum)
            tl.store(PartAcc + (out * R_PAD + offs_r[:, None]) * D + offs_d[None, :], acc)

    @triton.jit
    def attention_combine_kernel(PartMax, PartSum, PartAcc, Out,
                                 R: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, SLICES: tl.constexpr):
        bg = tl.program_id(0)
        offs_r = tl.arange(0, R_PAD)
        offs_d = tl.arange(0, D)
        top = tl.full([R_PAD], float("-inf"), tl.float32)
        for part in range(SLICES):
            top = tl.maximum(top, tl.load(PartMax + (bg * SLICES + part) * R_PAD + offs_r))
        numerator = tl.zeros([R_PAD, D], tl.float32)
        denominator = tl.zeros([R_PAD], tl.float32)
        for part in range(SLICES):
            row = (bg * SLICES + part) * R_PAD + offs_r
            w = tl.exp(tl.load(PartMax + row) - top)  # a slice that saw nothing: exp(-inf) = 0
            denominator += w * tl.load(PartSum + row)
            numerator += w[:, None] * tl.load(PartAcc + row[:, None] * D + offs_d[None, :])
        out = numerator / denominator[:, None]
        tl.store(Out + (bg * R + offs_r[:, None]) * D + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=offs_r[:, None] < R)

    class Kernels:
        @staticmethod
        def split(grid, *args, **meta):
            attention_split_kernel[grid](*args, **meta, num_warps=SPLIT_WARPS, num_stages=SPLIT_STAGES)

        @staticmethod
        def combine(grid, *args, **meta):
            attention_combine_kernel[grid](*args, **meta, num_warps=4)

    return Kernels
