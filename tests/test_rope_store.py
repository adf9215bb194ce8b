"""The engine's fused rotations and cache stores (models/rope_store.py): a static decode step's and a
window's (prefills, admissions).

On a CPU its torch reference equals megatron-core's RoPE followed by the cache writes (and the
engine's static step through it samples what the eager step samples: tests/test_static_decode.py);
the Triton kernel itself runs through Triton's interpreter where triton is installed
(tests/triton_interpreter.py), and compiled on a GPU (skipped without CUDA: CI has no GPU).
"""

import pytest
import torch
from triton_interpreter import run_interpreted

from megatron_rl.models import rope_store as rs


def _case(rows: int, heads: int, groups: int, dim: int, slots: int, dtype, device="cpu", seed=0, grouped=False):
    """Query, key and value as views of one fused projection (megatron-core's layout: per key group
    its query heads, its key, its value), caches with more rows than the step, RoPE frequencies at
    one slot. The query [rows, heads, dim] as megatron-core reshapes it (a copy), or with
    ``grouped`` the view [rows, groups, heads per group, dim] the engine's static step passes."""
    gen = torch.Generator().manual_seed(seed)
    per_group = heads // groups
    mixed = torch.randn(rows, groups, per_group + 2, dim, generator=gen).to(dtype)
    query, key, value = mixed[:, :, :per_group], mixed[:, :, per_group], mixed[:, :, per_group + 1]
    if not grouped:
        query = query.reshape(rows, heads, dim)
    keys = torch.randn(rows + 2, groups, slots, dim, generator=gen).to(dtype)
    values = torch.randn(rows + 2, groups, slots, dim, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = 37.0 * inv_freq
    freqs = torch.cat((freqs, freqs))  # megatron-core's layout: [f, f] over the head
    slot = torch.tensor([slots - 3])
    return [t.to(device) for t in (query, key, value, freqs, keys, values, slot)]


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dim", [8, 128])
def test_reference_equals_megatron_rope_and_cache_writes(dim, grouped):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    query, key, value, freqs, keys, values, slot = _case(5, 6, 2, dim, 40, torch.float64, grouped=grouped)
    expected_keys, expected_values = keys.clone(), values.clone()
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    rotated = rs.rope_store_reference(query, key, value, cos, sin, keys, values, slot)

    megatron = lambda t: _apply_rotary_pos_emb_bshd(t[None], freqs[None, None, None])[0]  # [seq, b, h, d]
    expected_keys[:5, :, slot.item()] = megatron(key)
    expected_values[:5, :, slot.item()] = value
    torch.testing.assert_close(rotated, megatron(query.reshape(5, 6, dim)), atol=1e-12, rtol=0)
    assert rotated.is_contiguous()
    torch.testing.assert_close(keys, expected_keys, atol=1e-12, rtol=0)
    assert torch.equal(values, expected_values)  # values stored as they are; other rows and slots untouched


def test_kernel_takes_power_of_two_head_dims():
    assert rs.supports(128) and rs.supports(8) and rs.supports(256)
    assert not rs.supports(96) and not rs.supports(4) and not rs.supports(80)


@pytest.mark.skipif(not rs.fused_available(torch.device("cuda")), reason="needs a GPU with triton")
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("rows,dim", [(1, 128), (256, 128), (7, 64)])
def test_triton_kernel_computes_the_reference(rows, dim, grouped):
    query, key, value, freqs, keys, values, slot = _case(rows, 12, 2, dim, 300, torch.bfloat16, device="cuda",
                                                         grouped=grouped)
    cos, sin = torch.cos(freqs).bfloat16(), torch.sin(freqs).bfloat16()
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = rs.rope_store_reference(query, key, value, cos, sin, ref_keys, ref_values, slot)
    out = rs.rope_store(query, key, value, cos, sin, keys, values, slot)
    assert torch.equal(out, expected) and torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


# fp32 and fp16 (the interpreter's numpy has no bfloat16); head dims 8 and 128; query, key and value
# strided views of one projection, the query also in its grouped layout; caches with rows the step
# does not write.
_INTERPRETED_CASES = r"""
import torch
from megatron_rl.models import rope_store as rs
from test_rope_store import _case

for rows, heads, groups, dim, dtype, grouped in [(3, 6, 2, 128, torch.float32, False),
                                                 (2, 4, 4, 8, torch.float16, False),
                                                 (5, 12, 2, 64, torch.float32, False),
                                                 (3, 6, 2, 128, torch.float32, True),
                                                 (2, 8, 2, 8, torch.float16, True)]:
    query, key, value, freqs, keys, values, slot = _case(rows, heads, groups, dim, 50, dtype, grouped=grouped)
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = rs.rope_store_reference(query, key, value, cos, sin, ref_keys, ref_values, slot)
    out = rs.rope_store(query, key, value, cos, sin, keys, values, slot)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert (out.float() - expected.float()).abs().max() <= tol, (rows, dim, dtype)
    assert (keys.float() - ref_keys.float()).abs().max() <= tol, (rows, dim, dtype)
    assert torch.equal(values, ref_values), (rows, dim, dtype)
print("interpreted rope_store ok")
"""


def test_triton_kernel_through_the_interpreter():
    run_interpreted(_INTERPRETED_CASES, "interpreted rope_store ok")


def _window_case(slots: int, rows: int, heads: int, groups: int, dim: int, dtype, device="cpu", seed=0,
                 grouped=False, cache_slots=50):
    """A window of ``slots`` new slots per row: query, key and value as views of one fused projection
    [slots, rows, ...] (the query reshaped as megatron-core does, or the grouped view), caches with
    rows before and after the window's, the window's RoPE frequencies."""
    gen = torch.Generator().manual_seed(seed)
    per_group = heads // groups
    mixed = torch.randn(slots, rows, groups, per_group + 2, dim, generator=gen).to(dtype)
    query, key, value = mixed[:, :, :, :per_group], mixed[:, :, :, per_group], mixed[:, :, :, per_group + 1]
    if not grouped:
        query = query.reshape(slots, rows, heads, dim)
    keys = torch.randn(rows + 3, groups, cache_slots, dim, generator=gen).to(dtype)
    values = torch.randn(rows + 3, groups, cache_slots, dim, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    positions = torch.arange(5, 5 + slots, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    freqs = torch.cat((freqs, freqs), dim=-1)  # [slots, dim], megatron-core's [f, f] per head
    return [t.to(device) for t in (query, key, value, freqs, keys, values)]


@pytest.mark.parametrize("grouped", [False, True])
def test_window_reference_equals_megatron_rope_and_cache_writes(grouped):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    query, key, value, freqs, keys, values = _window_case(6, 3, 6, 2, 16, torch.float64, grouped=grouped)
    expected_keys, expected_values = keys.clone(), values.clone()
    rotated = rs.rope_store_window_reference(query, key, value, torch.cos(freqs), torch.sin(freqs), keys, values,
                                             first=2, start=5)
    megatron = lambda t: _apply_rotary_pos_emb_bshd(t, freqs[:, None, None])  # [seq, b, h, d]
    expected_keys[2:5, :, 5:11] = megatron(key).permute(1, 2, 0, 3)
    expected_values[2:5, :, 5:11] = value.permute(1, 2, 0, 3)
    torch.testing.assert_close(rotated, megatron(query.reshape(6, 3, 6, 16)), atol=1e-12, rtol=0)
    assert rotated.is_contiguous() and rotated.shape == (6, 3, 6, 16)  # [slots, rows, heads, dim]
    torch.testing.assert_close(keys, expected_keys, atol=1e-12, rtol=0)
    assert torch.equal(values, expected_values)  # other rows and slots untouched


@pytest.mark.skipif(not rs.fused_available(torch.device("cuda")), reason="needs a GPU with triton")
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("slots,rows,dim", [(512, 64, 128), (1, 256, 128), (45, 7, 64)])
def test_window_kernel_computes_the_reference(slots, rows, dim, grouped):
    query, key, value, freqs, keys, values = _window_case(slots, rows, 12, 2, dim, torch.bfloat16, device="cuda",
                                                          grouped=grouped, cache_slots=slots + 20)
    cos, sin = torch.cos(freqs).bfloat16(), torch.sin(freqs).bfloat16()
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = rs.rope_store_window_reference(query, key, value, cos, sin, ref_keys, ref_values, 1, 7)
    out = rs.rope_store_window(query, key, value, cos, sin, keys, values, 1, 7)
    assert torch.equal(out, expected) and torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


# A window longer than one program's block and a partial one; rows written after cache row 0; both
# query layouts.
_INTERPRETED_WINDOW_CASES = r"""
import torch
from megatron_rl.models import rope_store as rs
from test_rope_store import _window_case

for slots, rows, heads, groups, dim, dtype, grouped in [(40, 2, 6, 2, 64, torch.float32, False),
                                                        (3, 3, 4, 4, 8, torch.float16, False),
                                                        (33, 2, 6, 2, 16, torch.float32, True),
                                                        (1, 2, 8, 2, 8, torch.float16, True)]:
    query, key, value, freqs, keys, values = _window_case(slots, rows, heads, groups, dim, dtype, grouped=grouped)
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = rs.rope_store_window_reference(query, key, value, cos, sin, ref_keys, ref_values, 1, 4)
    out = rs.rope_store_window(query, key, value, cos, sin, keys, values, 1, 4)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert out.shape == expected.shape and (out.float() - expected.float()).abs().max() <= tol, (slots, dim, dtype)
    assert (keys.float() - ref_keys.float()).abs().max() <= tol, (slots, dim, dtype)
    assert torch.equal(values, ref_values), (slots, dim, dtype)
print("interpreted rope_store_window ok")
"""


def test_window_kernel_through_the_interpreter():
    run_interpreted(_INTERPRETED_WINDOW_CASES, "interpreted rope_store_window ok")
