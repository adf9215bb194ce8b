"""The decode step's split-key attention (models/decode_attention.py).

On a CPU: the split-and-combine computation (what the Triton kernels do) equals plain attention,
with left padding, slots masked after the new token, and slices that see nothing; the Triton
kernels themselves run through Triton's interpreter where triton is installed
(tests/triton_interpreter.py). On a GPU they are compared with it compiled (skipped without CUDA:
CI has no GPU).
"""

import pytest
import torch
from triton_interpreter import run_interpreted

from megatron_rl.models import decode_attention as da


def _case(rows: int, groups: int, per_group: int, slots: int, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, groups, per_group, 64, generator=gen).to(dtype)
    # A view into a longer cache, as the engine passes it (batch and group strides of the cache).
    cache = torch.randn(2, rows + 3, groups, slots + 40, 64, generator=gen).to(dtype)
    key, value = cache[0, :rows, :, :slots], cache[1, :rows, :, :slots]
    masked = torch.zeros(rows, 1, 1, slots, dtype=torch.bool)
    current = slots - 70  # the new token's slot: later slots masked, as in a static-width step
    masked[..., current + 1:] = True
    for row in range(rows):  # left padding of varying length, some longer than a slice
        masked[row, ..., : (row * 37) % (current - 5)] = True
    bias = torch.zeros(masked.shape, dtype=dtype).masked_fill_(masked, float("-inf"))
    return [t.to(device) for t in (q, key, value, masked, bias)]


def _plain(q, key, value, masked, scale):
    scores = torch.matmul(q.double(), key.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), value.double())


@pytest.mark.parametrize("rows", [2, 64])
def test_split_and_combine_equals_plain_attention(rows):
    q, key, value, masked, bias = _case(rows, 2, 6, 700, torch.float32)
    slices, per_slice = da.split_plan(rows, 2, 700)
    assert slices > 1 and per_slice % da.BLOCK_SLOTS == 0
    out = da.split_decode_reference(q, key, value, bias, 0.125)
    torch.testing.assert_close(out.double(), _plain(q, key, value, masked, 0.125), atol=2e-5, rtol=1e-4)


def test_kernels_take_power_of_two_head_dims():
    assert da.supports(128, 6) and da.supports(64, 8) and da.supports(256, 1)
    assert not da.supports(80, 6) and not da.supports(96, 4) and not da.supports(8, 2)


def test_split_plan_gives_small_batches_more_slices():
    assert da.split_plan(256, 2, 768)[0] < da.split_plan(8, 2, 768)[0] <= -(-768 // da.BLOCK_SLOTS)
    slices, per_slice = da.split_plan(1, 1, 10)
    assert (slices, per_slice) == (1, da.BLOCK_SLOTS)


@pytest.mark.skipif(not da.triton_available(), reason="needs a GPU with triton")
@pytest.mark.parametrize("rows,slots", [(1, 100), (8, 640), (256, 768)])
def test_triton_kernels_compute_the_reference(rows, slots):
    q, key, value, masked, bias = _case(rows, 2, 6, slots, torch.bfloat16, device="cuda")
    out = da.decode_attention(q, key, value, bias, 0.088)
    expected = _plain(q, key, value, masked, 0.088)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    reference = da.split_decode_reference(q, key, value, bias, 0.088)
    assert (out.float() - reference.float()).abs().max() < 1e-2


# Shapes beyond Qwen2-1.5B's: one query head per group, head dims 16 and 128, several slices (of
# one block each, and of several: the online softmax's rescaling), fp16 and fp32 (the
# interpreter's numpy has no bfloat16), a key cache view with batch and group strides, left
# padding that masks whole blocks, a hole of masked blocks between seen slots, and slots masked
# after the new token. fp32 within 5e-5: triton versions sum the blocks in different orders (3.9
# measured 1.05e-5 at head dim 128).
_INTERPRETED_CASES = r"""
import torch
from megatron_rl.models import decode_attention as da
from test_decode_attention import _plain as plain

torch.manual_seed(0)
default_target = da.TARGET_PROGRAMS
for rows, groups, per_group, slots, dim, dtype, tol in [(3, 2, 6, 200, 64, torch.float32, 5e-5),
                                                        (2, 1, 1, 130, 16, torch.float16, 2e-3),
                                                        (4, 4, 8, 70, 128, torch.float32, 5e-5),
                                                        (64, 2, 2, 700, 16, torch.float32, 5e-5)]:
    q = torch.randn(rows, groups, per_group, dim).to(dtype)
    cache = torch.randn(2, rows + 1, groups, slots + 9, dim).to(dtype)
    key, value = cache[0, :rows, :, :slots], cache[1, :rows, :, :slots]
    masked = torch.zeros(rows, 1, 1, slots, dtype=torch.bool)
    masked[..., slots - 5:] = True
    masked[0, ..., : slots - 20] = True
    masked[1, ..., 60:140] = True  # a hole: a whole block masked between seen slots
    bias = torch.zeros(masked.shape, dtype=dtype).masked_fill_(masked, float("-inf"))
    # Sliced and combined; then one slice per row, which the split kernel writes itself.
    for target, sliced in ((default_target, True), (1, False)):
        da.TARGET_PROGRAMS = target
        assert (da.split_plan(rows, groups, slots)[0] > 1) == sliced
        out = da.decode_attention(q, key, value, bias, 0.5)
        error = (out.double() - plain(q, key, value, masked, 0.5)).abs().max().item()
        assert error < tol, (rows, groups, per_group, slots, dim, dtype, sliced, error)
    da.TARGET_PROGRAMS = default_target
print("interpreted kernels ok")
"""


def test_triton_kernels_through_the_interpreter():
    run_interpreted(_INTERPRETED_CASES, "interpreted kernels ok")


def _new_slot_case(rows: int, groups: int, per_group: int, slots: int, dim: int, dtype, device: str):
    """A static step's inputs: the fused QKV projection's views (query [rows, groups, per_group,
    dim], new key and value [rows, groups, dim]), RoPE's cos and sin at one position, a cache view
    and the new token's slot inside it (later slots masked, some left padding)."""
    gen = torch.Generator().manual_seed(3)
    mixed = torch.randn(rows, groups, (per_group + 2) * dim, generator=gen).to(dtype).to(device)
    query = mixed[..., : per_group * dim].unflatten(-1, (per_group, dim))
    key, value = mixed[..., per_group * dim : (per_group + 1) * dim], mixed[..., (per_group + 1) * dim :]
    angle = 37.0 * 10000.0 ** (-torch.arange(dim // 2).double() / (dim // 2))
    cos, sin = (torch.cat([f(angle), f(angle)]).to(dtype).to(device) for f in (torch.cos, torch.sin))
    cache = torch.randn(2, rows + 1, groups, slots + 9, dim, generator=gen).to(dtype).to(device)
    keys, values = cache[0, :rows, :, :slots], cache[1, :rows, :, :slots]
    current = slots - 6
    masked = torch.zeros(rows, 1, 1, slots, dtype=torch.bool, device=device)
    masked[..., current + 1:] = True
    masked[0, ..., : current // 2] = True
    bias = torch.zeros(masked.shape, dtype=dtype, device=device).masked_fill_(masked, float("-inf"))
    slot = torch.tensor([current], device=device)
    return query, key, value, cos, sin, cache, keys, values, bias, slot


def _rotate_then_attend(query, key, value, cos, sin, cache, keys, values, bias, slot, scale, rotate):
    """rope_store (``rotate``: its kernel or its torch reference) into a copy of the cache, then
    the decode kernel on the rotated query: the unfused path. Returns (output, the cache)."""
    from megatron_rl.models.rope_store import rope_store, rope_store_reference

    cache = cache.clone()
    rows, slots = keys.size(0), keys.size(2)
    keys, values = cache[0, :rows, :, :slots], cache[1, :rows, :, :slots]
    fn = rope_store if rotate == "kernel" else rope_store_reference
    rotated = fn(query, key, value, cos, sin, keys, values, slot)
    out = da.decode_attention(rotated.view(query.shape), keys, values, bias, scale)
    return out, cache


_INTERPRETED_NEW_SLOT = r"""
import torch
from megatron_rl.models import decode_attention as da
from test_decode_attention import _new_slot_case, _rotate_then_attend

default_target = da.TARGET_PROGRAMS
for rows, groups, per_group, slots, dim in [(4, 2, 3, 130, 64), (3, 1, 1, 70, 16)]:
    da.TARGET_PROGRAMS = default_target
    assert da.rotates_in_kernel(rows, groups, slots) is False  # few rows: several slices
    da.TARGET_PROGRAMS = 1  # one slice per row, where the kernel may rotate and store
    assert da.rotates_in_kernel(rows, groups, slots)
    query, key, value, cos, sin, cache, keys, values, bias, slot = _new_slot_case(
        rows, groups, per_group, slots, dim, torch.float32, "cpu")
    expected, expected_cache = _rotate_then_attend(query, key, value, cos, sin, cache, keys, values, bias, slot,
                                                   0.3, "reference")
    out = da.decode_attention(query, keys, values, bias, 0.3, da.NewSlot(key, value, cos, sin, slot))
    assert torch.equal(cache, expected_cache), "the new key and value stored where rope_store stores them"
    error = (out - expected).abs().max().item()
    assert error < 5e-5, (rows, groups, per_group, slots, dim, error)
print("interpreted new slot ok")
"""


def test_kernel_rotating_and_storing_the_new_slot_through_the_interpreter():
    run_interpreted(_INTERPRETED_NEW_SLOT, "interpreted new slot ok")


@pytest.mark.skipif(not da.triton_available(), reason="needs a GPU with triton")
def test_kernel_rotating_the_new_slot_gives_the_unfused_bits_on_a_gpu():
    """At the engine's shape (256 rows, 2 key groups of 6 heads, head dim 128, bf16) the fused
    kernel's output and cache are bit for bit those of rope_store's kernel then the decode kernel."""
    case = _new_slot_case(256, 2, 6, 640, 128, torch.bfloat16, "cuda")
    query, key, value, cos, sin, cache, keys, values, bias, slot = case
    assert da.rotates_in_kernel(256, 2, 640)
    expected, expected_cache = _rotate_then_attend(*case, 0.088, "kernel")
    out = da.decode_attention(query, keys, values, bias, 0.088, da.NewSlot(key, value, cos, sin, slot))
    assert torch.equal(cache, expected_cache)
    assert torch.equal(out, expected)


def test_a_failing_rotating_kernel_falls_back_to_torchs_rotation_store_and_attention(monkeypatch):
    """If the decode kernel fails with a new slot to rotate and store, the core attention does the
    rotation and the store with torch ops, attends with torch's fused kernel, and keeps torch's
    kernel from then on: the same output and cache as the unfused path."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models import kv_attention
    from megatron_rl.models.rope_store import rope_store_reference

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(kv_attention, "decode_attention", broken)
    monkeypatch.setattr(kv_attention.CachedKVAttention, "decode_kernel", "triton")
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0)
    attention = kv_attention.CachedKVAttention(config, 1, AttnMaskType.no_mask, "self")
    query, key, value, cos, sin, cache, keys, values, bias, slot = _new_slot_case(3, 2, 2, 20, 16, torch.float32, "cpu")
    masked = torch.isinf(bias)
    expected_cache = cache.clone()
    rotated = rope_store_reference(query, key, value, cos, sin, expected_cache[0, :3, :, :20],
                                   expected_cache[1, :3, :, :20], slot)
    expected = _plain(rotated.view(query.shape), expected_cache[0, :3, :, :20], expected_cache[1, :3, :, :20],
                      masked, attention.softmax_scale)
    attention.new_slot = da.NewSlot(key, value, cos, sin, slot)
    out = attention(query.unsqueeze(0), keys, values, masked)
    assert attention.new_slot is None and kv_attention.CachedKVAttention.decode_kernel == "sdpa"
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(out.double(), expected.reshape(1, 3, 64), atol=1e-5, rtol=1e-5)


def test_a_new_slot_left_behind_is_dropped_by_a_forward_that_is_not_a_static_step():
    """A new slot whose static step failed before its core attention is not applied to the next
    forward (a prefill's query is [slots, rows, heads, dim]): that forward attends as usual and
    the slot is gone."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models import kv_attention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0)
    attention = kv_attention.CachedKVAttention(config, 1, AttnMaskType.no_mask, "self")
    query, key, value, cos, sin, cache, keys, values, bias, slot = _new_slot_case(3, 2, 2, 20, 16, torch.float32, "cpu")
    prefill_query = torch.randn(5, 3, 4, 16)
    window_keys, window_values = keys[:, :, :5].clone(), values[:, :, :5].clone()
    expected = attention(prefill_query, window_keys, window_values, None)
    attention.new_slot = da.NewSlot(key, value, cos, sin, slot)
    before = cache.clone()
    out = attention(prefill_query, window_keys, window_values, None)
    assert attention.new_slot is None and torch.equal(out, expected) and torch.equal(cache, before)
