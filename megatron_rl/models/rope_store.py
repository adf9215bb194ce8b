"""The query and key rotation and the cache store of the engine's forwards, as one Triton kernel
each: a decode step's (``rope_store``) and a prefill's (``rope_store_window``).

In a static decode step (one new token per row, its cache slot held on the device) each layer
otherwise runs five small kernels before its attention: RoPE on the query, RoPE on the key, an
``index_copy_`` storing the key and another storing the value, and a copy making the query
contiguous for the attention kernel. At batch 256 each moves well under a megabyte and costs a few
microseconds of launch and tail inside the CUDA graph, about 0.4 ms of a 4.5 ms step over 28
layers (measured on an H200). Here one program per (row, query head or key group) reads its head
once, rotates it in fp32 and writes it where it goes: the query to a contiguous
[rows, heads, dim] tensor, the key and the value to the cache at the step's slot. The query may
come in the fused QKV projection's own layout, [rows, groups, heads per group, dim] (a view of it):
megatron-core's split reshapes it to [rows, heads, dim], one more copy per layer, which the
engine's static step skips (models/kv_attention.py).

The rotation is megatron-core's ``t * cos + rotate_half(t) * sin`` over the whole head (not
interleaved), computed in fp32 and rounded once, as the compiled RoPE the unfused path runs
(models/compiled_rope.py). ``rope_store_reference`` computes the same with torch ops on any
device: CPU tests run the engine's static step through it, and compare the Triton kernel with it
through Triton's interpreter (tests/test_rope_store.py).

A prefill (or an admission's) forward writes a window of slots per row: there megatron-core's
path ran, per layer, the query's reshape, RoPE on the query and on the key (compiled), the key's
and the value's cache stores and, in torch's attention, the query's layout change: about seven
launches moving the query's 400 MB four times at 256 prompts of 512 tokens. ``rope_store_window``
reads the fused projection once and writes the rotated query contiguous, as [slots, rows, heads,
dim], the rotated key and the value into the cache's window. torch's cuDNN attention gives its
output the query's memory layout, so the attention's output is then megatron-core's
[slots, rows, heads x dim] without a copy (the query in [rows, heads, slots, dim] left a 0.6 ms
copy of the output per layer on an H100).
"""

from __future__ import annotations

import functools

import torch

from .compiled_rope import _rotate as megatron_rotation
from .decode_attention import triton_available


def supports(head_dim: int) -> bool:
    """Head dimensions the kernel takes: a power of two from 8 to 512 (its halves are Triton
    blocks)."""
    return 8 <= head_dim <= 512 and head_dim & (head_dim - 1) == 0


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The compiled RoPE's rotation (not interleaved) in fp32 at least, rounded once."""
    wide = torch.promote_types(t.dtype, torch.float32)
    return megatron_rotation(t.to(wide), cos.to(wide), sin.to(wide), False).to(t.dtype)


def rope_store_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         slot: torch.Tensor) -> torch.Tensor:
    """query [rows, heads, dim] or [rows, groups, heads per group, dim] (the fused projection's own
    layout, read without a copy), key and value [rows, groups, dim] (views; the last dimension
    contiguous), cos and sin [dim] (scaled, in the model's dtype), the caches ``keys`` and
    ``values`` [max rows, groups, slots, dim], ``slot`` [1] int64 on the device. Stores the rotated
    key and the value at ``slot`` of rows 0..rows; returns the rotated query [rows, heads, dim],
    contiguous."""
    rows = query.size(0)
    if query.dim() == 4:
        query = query.flatten(1, 2)
    keys[:rows].index_copy_(2, slot, _rotate(key, cos, sin).unsqueeze(2))
    values[:rows].index_copy_(2, slot, value.unsqueeze(2))
    return _rotate(query, cos, sin).contiguous()


def rope_store(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (arguments and result as in ``rope_store_reference``)."""
    grouped = query if query.dim() == 4 else query.unsqueeze(1)  # [rows, groups, heads per group, dim]
    rows, _, per_group, dim = grouped.shape
    heads, groups = grouped.size(1) * per_group, key.size(1)
    out = torch.empty((rows, heads, dim), dtype=query.dtype, device=query.device)
    _kernel()[(rows, heads + groups)](
        grouped, key, value, cos, sin, keys, values, slot, out,
        grouped.stride(0), grouped.stride(1), grouped.stride(2), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
        values.stride(2), heads, per_group, HALF=dim // 2, num_warps=1,
    )
    return out


def rope_store_window_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int,
                                start: int) -> torch.Tensor:
    """A window of new slots per row: query [new slots, rows, heads, dim] or
    [new slots, rows, groups, heads per group, dim] (the fused projection's layout), key and value
    [new slots, rows, groups, dim] (views; the last dimension contiguous), cos and sin
    [new slots, dim] (the window's positions, scaled, in the model's dtype), the caches as in
    ``rope_store_reference``. Stores the rotated key and the value at slots start.. of cache rows
    first..; returns the rotated query as [new slots, rows, heads, dim], contiguous."""
    slots, rows = key.shape[:2]
    if query.dim() == 5:
        query = query.flatten(2, 3)
    cos, sin = cos[:, None, None], sin[:, None, None]
    keys[first : first + rows, :, start : start + slots] = _rotate(key, cos, sin).permute(1, 2, 0, 3)
    values[first : first + rows, :, start : start + slots] = value.permute(1, 2, 0, 3)
    return _rotate(query, cos, sin).contiguous()


# Slots per program of the window kernel: 32 x 128 features of a head, read and written once.
WINDOW_BLOCK = 32


def rope_store_window(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int,
                      start: int) -> torch.Tensor:
    """The Triton kernel (arguments and result as in ``rope_store_window_reference``)."""
    grouped = query if query.dim() == 5 else query.unsqueeze(2)  # [slots, rows, groups, heads per group, dim]
    slots, rows, _, per_group, dim = grouped.shape
    heads, groups = grouped.size(2) * per_group, key.size(2)
    out = torch.empty((slots, rows, heads, dim), dtype=query.dtype, device=query.device)
    grid = (-(-slots // WINDOW_BLOCK), rows, heads + groups)
    _window_kernel()[grid](
        grouped, key, value, cos, sin, keys, values, out, slots, rows, first, start,
        grouped.stride(0), grouped.stride(1), grouped.stride(2), grouped.stride(3), key.stride(0), key.stride(1),
        key.stride(2), value.stride(0), value.stride(1), value.stride(2), keys.stride(0), keys.stride(1),
        keys.stride(2), values.stride(0), values.stride(1), values.stride(2), heads, per_group,
        HALF=dim // 2, BLOCK=WINDOW_BLOCK, num_warps=4,
    )
    return out


def fused_available(device: torch.device) -> bool:
    """Whether ``rope_store`` can run on ``device`` (a GPU, triton importable)."""
    return device.type == "cuda" and triton_available()


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_store_kernel(Q, K, V, Cos, Sin, KC, VC, Slot, QOut,
                          sqb, sqg, sqh, skb, skg, svb, svg, skcb, skcg, skcs, svcb, svcg, svcs,
                          H, R, HALF: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)  # 0..H-1: a query head; H..: a key group
        lo = tl.arange(0, HALF)
        hi = lo + HALF
        cos_lo = tl.load(Cos + lo).to(tl.float32)
        cos_hi = tl.load(Cos + hi).to(tl.float32)
        sin_lo = tl.load(Sin + lo).to(tl.float32)
        sin_hi = tl.load(Sin + hi).to(tl.float32)
        if head < H:
            src = Q + row * sqb + (head // R) * sqg + (head % R) * sqh
            dst = QOut + (row * H + head) * (2 * HALF)
        else:
            group = head - H
            src = K + row * skb + group * skg
            slot = tl.load(Slot)
            dst = KC + row.to(tl.int64) * skcb + group * skcg + slot * skcs
            v_dst = VC + row.to(tl.int64) * svcb + group * svcg + slot * svcs
            v_src = V + row * svb + group * svg
            tl.store(v_dst + lo, tl.load(v_src + lo))
            tl.store(v_dst + hi, tl.load(v_src + hi))
        x_lo = tl.load(src + lo).to(tl.float32)
        x_hi = tl.load(src + hi).to(tl.float32)
        # t * cos + rotate_half(t) * sin, rotate_half(t) = cat(-t_hi, t_lo)
        tl.store(dst + lo, (x_lo * cos_lo - x_hi * sin_lo).to(dst.dtype.element_ty))
        tl.store(dst + hi, (x_hi * cos_hi + x_lo * sin_hi).to(dst.dtype.element_ty))

    return rope_store_kernel


@functools.lru_cache(maxsize=1)
def _window_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_store_window_kernel(Q, K, V, Cos, Sin, KC, VC, QOut, S, B, first, start,
                                 sqs, sqb, sqg, sqh, sks, skb, skg, svs, svb, svg, skcb, skcg, skcs,
                                 svcb, svcg, svcs, H, R, HALF: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(1)
        head = tl.program_id(2)  # 0..H-1: a query head; H..: a key group
        pos = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        live = (pos < S)[:, None]
        lo = tl.arange(0, HALF)[None, :]
        hi = lo + HALF
        at = pos[:, None] * (2 * HALF)
        cos_lo = tl.load(Cos + at + lo, mask=live).to(tl.float32)
        cos_hi = tl.load(Cos + at + hi, mask=live).to(tl.float32)
        sin_lo = tl.load(Sin + at + lo, mask=live).to(tl.float32)
        sin_hi = tl.load(Sin + at + hi, mask=live).to(tl.float32)
        if head < H:
            src = Q + pos[:, None] * sqs + row * sqb + (head // R) * sqg + (head % R) * sqh
            dst = QOut + ((pos[:, None] * B + row) * H + head) * (2 * HALF)
        else:
            group = head - H
            src = K + pos[:, None] * sks + row * skb + group * skg
            slot = start + pos[:, None]
            dst = KC + (first + row).to(tl.int64) * skcb + group * skcg + slot * skcs
            v_src = V + pos[:, None] * svs + row * svb + group * svg
            v_dst = VC + (first + row).to(tl.int64) * svcb + group * svcg + slot * svcs
            tl.store(v_dst + lo, tl.load(v_src + lo, mask=live), mask=live)
            tl.store(v_dst + hi, tl.load(v_src + hi, mask=live), mask=live)
        x_lo = tl.load(src + lo, mask=live).to(tl.float32)
        x_hi = tl.load(src + hi, mask=live).to(tl.float32)
        # t * cos + rotate_half(t) * sin, rotate_half(t) = cat(-t_hi, t_lo)
        tl.store(dst + lo, (x_lo * cos_lo - x_hi * sin_lo).to(dst.dtype.element_ty), mask=live)
        tl.store(dst + hi, (x_hi * cos_hi + x_lo * sin_hi).to(dst.dtype.element_ty), mask=live)

    return rope_store_window_kernel
