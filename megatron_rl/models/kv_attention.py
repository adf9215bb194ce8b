"""Attention for the rollout engine's KV cache: keys rotated once, when written; two batched
matmuls per layer.

megatron-core's static-batching path stores keys before RoPE, in a [slots, batch, groups, dim]
cache, and on every decode step re-rotates every cached key, repeats keys and values per query
head (GQA) and transposes them for a batched matmul. On a CPU that costs about 0.36 us per cached
slot per row (2 layers, head dim 16), ten times the attention's own arithmetic, so a row pays for
the whole shared window however short its own sequence is. Here:

- ``EngineKVContext`` (a ``StaticInferenceContext``) keeps each layer's cache as
  [batch, groups, slots, dim], the layout a batched matmul reads without a copy, and does the
  engine's row and slot moves (compacting finished rows away, sliding the window left) for every
  layer at once.
- ``EngineSelfAttention`` rotates only the new keys, at their own slot positions, before storing
  them; the query is rotated as before. RoPE scores depend only on relative positions, so this
  computes what re-rotating every step computed (up to float rounding).
- ``CachedKVAttention`` is the core attention: one batched matmul per key group over the cache
  view (no per-head copy of the keys), masked by filling with the dtype's minimum (a fully masked
  row, e.g. a left-padding query, gets a uniform softmax instead of NaN, as with Megatron's masked
  fill). torch's fused CPU kernel (scaled_dot_product_attention) was up to 3x slower for a
  one-token query, erratically with the window's length (measured 0.46 ms at 150 slots, 1.6 ms at
  200, 0.69 ms at 250; these matmuls 0.47 / 0.48 / 0.65).

Only the engine's model uses these (``build_gpt_model(..., kv_attention=True)``); the learner's
forward is unchanged. Multi-latent attention keeps Megatron's cache layout (models/mla.py).
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention, _yarn_get_concentration_factor_from_config
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule

from .compiled_rope import cos_sin
from .decode_attention import NewSlot, decode_attention, rotates_in_kernel, supports, triton_available
from .rope_store import fused_available as rope_store_available
from .rope_store import rope_store, rope_store_reference, rope_store_window, rope_store_window_reference
from .rope_store import supports as rope_store_supports

logger = logging.getLogger(__name__)

Cache = Tuple[torch.Tensor, torch.Tensor]


class _EngineForward(threading.local):
    """Whether this thread is inside an ``EngineSelfAttention`` forward over the engine's cache (a
    prefill, an admission or a decode step): the engine's forwards run on its compute thread, a
    colocated learner's on another."""

    active = False


_engine_forward = _EngineForward()


class EngineKVContext(StaticInferenceContext):
    """The engine's KV cache. Layers using ``EngineSelfAttention`` live in ``layers`` (keys
    rotated, [batch, groups, slots, dim]); any other attention (MLA, models/mla.py) keeps
    Megatron's ``key_value_memory_dict`` ([slots, batch, ...]). The row and slot operations cover both."""

    def __init__(self, max_batch_size: int, max_sequence_length: int, model_config=None):
        super().__init__(max_batch_size, max_sequence_length)
        self.layers: Dict[int, Cache] = {}
        self._model_config = model_config  # rotary_interleaved, for re-rotating moved keys
        # A decode step with static shapes (rollout/embedded/decode_graphs.py), as a CUDA graph
        # replays it: the new token's slot comes from this device tensor ([1] int64) instead of
        # the Python offset, and every step reads ``static_width`` slots (the rest masked).
        self.static_slot: Optional[torch.Tensor] = None
        self.static_width = 0
        # The RoPE table's rows at ``static_slot``, looked up by the step's first layer: (table, rows).
        self._slot_rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @contextmanager
    def static_step(self, slot: torch.Tensor, width: int):
        """Within: a static-shape decode step writing slot ``slot`` ([1] int64 on the device) and
        reading ``width`` slots."""
        self.static_slot, self.static_width = slot, width
        try:
            yield
        finally:
            self.static_slot, self._slot_rotary = None, None

    def slot_rotary(self, table: torch.Tensor) -> torch.Tensor:
        """``table``'s rows ([slots, 1, 1, dim] RoPE frequencies) at the static slot: one lookup per
        step, which every layer shares (they all get the same table)."""
        if self._slot_rotary is None or self._slot_rotary[0] is not table:
            self._slot_rotary = (table, table.index_select(0, self.static_slot))
        return self._slot_rotary[1]

    def cache(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Cache:
        """``layer``'s whole cache, [max rows, groups, slots, dim] keys and values (made on first
        use, shaped after ``key`` and ``value``: [new slots, rows, groups, dim])."""
        if layer not in self.layers:
            shape = (self.max_batch_size, key.size(2), self.max_sequence_length, key.size(3))
            self.layers[layer] = (torch.zeros(shape, dtype=key.dtype, device=key.device),
                                  torch.zeros(shape, dtype=value.dtype, device=value.device))
        return self.layers[layer]

    def static_view(self, keys: torch.Tensor, values: torch.Tensor, rows: int) -> Cache:
        """What a static step's attention reads: ``rows`` rows, ``static_width`` slots."""
        return keys[:rows, :, : self.static_width], values[:rows, :, : self.static_width]

    def window(self, key: torch.Tensor) -> Tuple[slice, int, int]:
        """Where a forward's new ``key`` ([new slots, rows, groups, dim]) goes outside a static
        step: its cache rows (from the batch offset), its first slot (the sequence offset) and the
        slot after its last."""
        start, first = self.sequence_len_offset, self.batch_size_offset
        end = start + key.size(0)
        if end > self.max_sequence_length:
            raise RuntimeError(f"KV cache of {self.max_sequence_length} slots is full")
        return slice(first, first + key.size(1)), start, end

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Cache:
        """Store ``key`` (rotated) and ``value`` ([new slots, rows, groups, dim]) at the current
        offsets; return the rows' keys and values up to the last new slot, [rows, groups, slots, dim]."""
        keys, values = self.cache(layer, key, value)
        if self.static_slot is not None:
            rows = slice(0, key.size(1))
            keys[rows].index_copy_(2, self.static_slot, key.permute(1, 2, 0, 3))
            values[rows].index_copy_(2, self.static_slot, value.permute(1, 2, 0, 3))
            return self.static_view(keys, values, key.size(1))
        rows, start, end = self.window(key)
        keys[rows, :, start:end] = key.permute(1, 2, 0, 3)
        values[rows, :, start:end] = value.permute(1, 2, 0, 3)
        return keys[rows, :, :end], values[rows, :, :end]

    def _megatron_layers(self):
        return self.key_value_memory_dict.values()

    def copy_rows(self, first: int, source: torch.Tensor, slots: int) -> None:
        """Rows ``first``.. become copies of rows ``source`` (their first ``slots`` slots)."""
        rows = slice(first, first + len(source))
        for key, value in self.layers.values():
            key[rows, :, :slots] = key[source, :, :slots]
            value[rows, :, :slots] = value[source, :, :slots]
        for key, value in self._megatron_layers():
            key[:slots, rows] = key[:slots, source]
            value[:slots, rows] = value[:slots, source]

    def clear_slots(self, rows: slice, end: int) -> None:
        """Zero slots ..``end`` of ``rows``: masked, but zero so that 0 * garbage cannot be NaN."""
        for key, value in self.layers.values():
            key[rows, :, :end] = 0
            value[rows, :, :end] = 0
        for key, value in self._megatron_layers():
            key[:end, rows] = 0
            value[:end, rows] = 0

    def shift_left(self, shift: int, end: int, rows: int, unrotate: Optional[torch.Tensor]) -> None:
        """Move slots ``shift``..``end`` of the first ``rows`` rows to slot 0. Rotated keys are
        rotated back by ``shift`` positions (``unrotate``: RoPE frequencies of position -shift,
        [1, 1, 1, dim]) so they match the slots they now occupy."""
        kept = end - shift
        for key, value in self.layers.values():
            moved = key[:rows, :, shift:end]
            if unrotate is not None:  # rotate_pos_emb works on [seq, ...]: the slot axis first
                moved = apply_rotary_pos_emb(moved.transpose(0, 2), unrotate, config=self._model_config).transpose(0, 2)
            key[:rows, :, :kept] = moved.clone()
            value[:rows, :, :kept] = value[:rows, :, shift:end].clone()
        for key, value in self._megatron_layers():
            key[:kept, :rows] = key[shift:end, :rows].clone()
            value[:kept, :rows] = value[shift:end, :rows].clone()


class EngineSelfAttention(SelfAttention):
    """SelfAttention whose inference cache holds rotated keys (see the module docstring)."""

    # Engine forwards rotate and store through models/rope_store.py's Triton kernels on a
    # GPU; tests set this to run its torch reference on a CPU.
    rope_store_on_cpu = False
    rope_store_failed = False  # set by the first failure of a Triton kernel: torch ops from then on

    def forward(self, *args, **kwargs):
        context = kwargs.get("inference_context", kwargs.get("inference_params"))
        if context is None and len(args) > 3:
            context = args[3]
        outer, _engine_forward.active = _engine_forward.active, isinstance(context, EngineKVContext)
        try:
            return super().forward(*args, **kwargs)
        finally:
            _engine_forward.active = outer

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        """In a forward over the engine's cache: the query as a view of the fused projection,
        [sq, b, groups, heads per group, dim], instead of megatron-core's reshape of it to
        [sq, b, heads, dim] (a copy per layer); the fused rotations read it there
        (``_rope_and_store``, ``_rope_and_store_window``). Elsewhere, and where megatron-core does
        more to the query (norms, an output gate, query groups split over tensor-parallel ranks),
        megatron-core's own."""
        if not (_engine_forward.active and split_qkv and not output_gate and key_value_states is None
                and _identity(self.q_layernorm) and _identity(self.k_layernorm)
                and self.config.num_query_groups >= self.world_size):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                       split_qkv=split_qkv)
        mixed, _ = self.linear_qkv(hidden_states)
        per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        dim = self.hidden_size_per_attention_head
        mixed = mixed.view(*mixed.shape[:-1], self.num_query_groups_per_partition, (per_group + 2) * dim)
        query = mixed[..., : per_group * dim].unflatten(-1, (per_group, dim))
        return query, mixed[..., per_group * dim : (per_group + 1) * dim], mixed[..., (per_group + 1) * dim :]

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb,
                                        rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                                        sequence_len_offset=None, *, inference_params=None):
        engine = isinstance(inference_context, EngineKVContext)
        slot = inference_context.static_slot if engine else None
        if engine and rotary_pos_emb is not None and self._rope_store_applies(query, *rotary_pos_emb):
            if slot is not None:
                return self._rope_and_store(inference_context, query, key, value, rotary_pos_emb[0])
            return self._rope_and_store_window(inference_context, query, key, value, rotary_pos_emb[0])
        if query.dim() == 5:  # the fused projection's layout (get_query_key_value_tensors): reshape after all
            query = query.flatten(2, 3)
        if not engine:
            return super()._adjust_key_value_for_inference(
                inference_context or inference_params, query, key, value, rotary_pos_emb, rotary_pos_cos,
                rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset)
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            if slot is not None:  # one new token per row, at a slot held on the device
                q_pos_emb = inference_context.slot_rotary(q_pos_emb)
                k_pos_emb = inference_context.slot_rotary(k_pos_emb)
            else:
                start = inference_context.sequence_len_offset
                window = slice(start, start + key.size(0))
                q_pos_emb, k_pos_emb = q_pos_emb[window], k_pos_emb[window]
            key = apply_rotary_pos_emb(key, k_pos_emb, config=self.config)
            rotary_pos_emb = (q_pos_emb, None)  # forward rotates the query only
        key, value = inference_context.write(self.layer_number, key, value)
        return query, key, value, rotary_pos_emb, AttnMaskType.no_mask, None

    def _rope_store_applies(self, query: torch.Tensor, q_pos_emb, k_pos_emb) -> bool:
        """Whether an engine forward's rotation and cache store can be one fused call
        (models/rope_store.py, a static step's or a window's): the query and key share one
        frequency table over whole heads, not interleaved, no attention scaling folded into the
        rotation (YaRN), the kernel available (or ``rope_store_on_cpu``)."""
        return (q_pos_emb is k_pos_emb and q_pos_emb.size(-1) == query.size(-1) and rope_store_supports(query.size(-1))
                and not self.config.rotary_interleaved and not self.config.multi_latent_attention
                and _yarn_get_concentration_factor_from_config(self.config) == 1.0
                and (rope_store_available(query.device) or self.rope_store_on_cpu))

    def _fused_rope_store(self, fused, reference, *args) -> torch.Tensor:
        """``fused`` (a Triton kernel of models/rope_store.py) on a GPU, ``reference`` (its torch ops)
        where it cannot run or has failed once."""
        if rope_store_available(args[0].device) and not EngineSelfAttention.rope_store_failed:
            try:
                return fused(*args)
            except Exception as exc:  # noqa: BLE001 - a triton failure must not stop generation
                logger.warning("triton RoPE and cache store failed (%s); using torch's kernels", exc)
                EngineSelfAttention.rope_store_failed = True
        return reference(*args)

    def _rope_and_store_window(self, context: EngineKVContext, query, key, value, freqs):
        """A prefill's (or an admission's) query and key rotated and the key and value stored in
        the cache's window (slots from the context's offset, rows from its batch offset) in one
        call. The query comes back rotated, [sq, b, heads, dim] and contiguous."""
        rows, start, end = context.window(key)
        cos, sin = cos_sin(freqs[start:end], 1.0, query.dtype)
        keys, values = context.cache(self.layer_number, key, value)
        rotated = self._fused_rope_store(rope_store_window, rope_store_window_reference, query, key, value,
                                         cos.reshape(key.size(0), -1), sin.reshape(key.size(0), -1), keys,
                                         values, rows.start, start)
        return rotated, keys[rows, :, :end], values[rows, :, :end], None, AttnMaskType.no_mask, None

    def _rope_and_store(self, context: EngineKVContext, query, key, value, freqs):
        """The static step's query and key rotated and the key and value stored at the step's slot
        in one call; the query comes back rotated (Megatron's forward then rotates nothing). Where
        the Triton decode attention can do that itself (``_attention_rotates``), the query comes
        back unrotated, as [1, rows, groups, heads per group, dim], and the core attention is
        handed the new slot to rotate and store before it attends (one launch fewer per layer)."""
        cos, sin = cos_sin(context.slot_rotary(freqs), 1.0, query.dtype)
        keys, values = context.cache(self.layer_number, key, value)
        new = NewSlot(key[0], value[0], cos.reshape(-1), sin.reshape(-1), context.static_slot)
        if self._attention_rotates(query, key, context.static_width):
            self.core_attention.new_slot = new
            key, value = context.static_view(keys, values, key.size(1))
            grouped = query if query.dim() == 5 else query.unflatten(-2, (key.size(1), -1))
            return grouped, key, value, None, AttnMaskType.no_mask, None
        rotated = self._fused_rope_store(rope_store, rope_store_reference, query[0], *new[:4], keys, values,
                                         new.slot)
        key, value = context.static_view(keys, values, key.size(1))
        return rotated.unsqueeze(0), key, value, None, AttnMaskType.no_mask, None

    def _attention_rotates(self, query: torch.Tensor, key: torch.Tensor, width: int) -> bool:
        """Whether this static step's core attention is the Triton decode kernel at a shape where
        it can rotate and store the new slot itself (``decode_attention.rotates_in_kernel``)."""
        rows, groups = key.size(1), key.size(2)
        return (isinstance(self.core_attention, CachedKVAttention) and not EngineSelfAttention.rope_store_failed
                and self.core_attention.triton_decodes(query, self.num_attention_heads_per_partition // groups)
                and rotates_in_kernel(rows, groups, width))


class CachedKVAttention(MegatronModule):
    """Core attention over ``EngineKVContext``'s cache view: query [sq, b, heads, dim], key and
    value [b, groups, slots, dim], mask [b, 1, sq, slots] (True: masked; None: causal, the queries
    being the last sq slots) -> [sq, b, heads * dim]."""

    # On a GPU attention runs torch's fused kernels; tests set this to run them on a CPU as well.
    fused_on_cpu = False
    # A decode step's attention on a GPU: triton (decode_attention.py; torch's fused kernel where
    # triton does not import) | sdpa (torch's fused kernel) | matmul (two batched matmuls, as on a
    # CPU). tools/bench/engine_gpu.py --decode-attention compares them.
    decode_kernel = "triton"

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale: Optional[float] = None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        # Megatron's layer scaling (apply_query_key_layer_scaling) divides the scores by the layer
        # number and multiplies them back inside its softmax: the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    # A static step's new slot, when its attention module left the rotation and store to the
    # decode kernel (EngineSelfAttention._rope_and_store): the query then comes unrotated,
    # [1, rows, groups, heads per group, dim]. Taken by the next forward.
    new_slot: Optional[NewSlot] = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        new, self.new_slot = self.new_slot, None
        if new is not None and query.dim() == 5:  # (a slot left by a forward that failed before here is dropped)
            return self._rotating_decode(query[0], key, value, attention_mask, new)
        sq, b, heads, dim = query.shape
        groups = key.size(1)
        if query.is_cuda or self.fused_on_cpu:
            if sq > 1:
                return self._fused_prefill(query, key, value, attention_mask)
            if self.decode_kernel != "matmul":
                return self._fused_decode(query, key, value, attention_mask)
        if attention_mask is None:
            attention_mask = trailing_causal_mask(sq, key.size(2), query.device)
        # A group's query heads are consecutive (head i reads group i // (heads / groups)): one
        # batched matmul per group against its keys, no copy of the keys per head.
        q = query.permute(1, 2, 0, 3).reshape(b, groups, heads // groups * sq, dim)
        scores = torch.matmul(q, key.transpose(-1, -2)).mul_(self.softmax_scale)  # [b, g, r * sq, slots]
        slots = scores.size(-1)
        scores.view(b, groups, heads // groups, sq, slots).masked_fill_(
            attention_mask.unsqueeze(2), torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
        out = torch.matmul(probs, value)  # [b, g, r * sq, dim]
        return out.view(b, heads, sq, dim).permute(2, 0, 1, 3).reshape(sq, b, heads * dim)

    def _fused_decode(self, query, key, value, attention_mask):
        """One new token per row: a group's query heads are the "sequence" of one fused call over
        that group's keys (no copy of the keys per head), every query masked alike. Each row must
        see at least one slot (a fully masked row would be NaN): its new token's own."""
        _, b, heads, dim = query.shape
        groups = key.size(1)
        q = query.reshape(b, groups, heads // groups, dim)
        bias = decode_bias(attention_mask, q.dtype)
        if self.triton_decodes(q, heads // groups):
            try:
                return decode_attention(q, key, value, bias, self.softmax_scale).reshape(1, b, heads * dim)
            except Exception as exc:  # noqa: BLE001 - a triton failure must not stop generation
                logger.warning("triton decode attention failed (%s); using torch's fused kernel", exc)
                CachedKVAttention.decode_kernel = "sdpa"
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=bias, scale=self.softmax_scale)
        return out.reshape(1, b, heads * dim)

    def triton_decodes(self, query: torch.Tensor, per_group: int) -> bool:
        """Whether a decode step's attention on ``query`` (its last dimension the head's) runs the
        Triton kernel of models/decode_attention.py: the kernel chosen, on a GPU, at a shape it takes."""
        return (self.decode_kernel == "triton" and query.is_cuda and triton_available()
                and supports(query.size(-1), per_group))

    def _rotating_decode(self, query, key, value, attention_mask, new: NewSlot):
        """The Triton decode kernel rotating the query and the new key and storing the new key and
        value itself (query [rows, groups, heads per group, dim], unrotated). If it fails: the
        rotation and store by torch ops, then torch's fused attention."""
        b, groups, per_group, dim = query.shape
        bias = decode_bias(attention_mask, query.dtype)
        try:
            return decode_attention(query, key, value, bias, self.softmax_scale, new).reshape(1, b, -1)
        except Exception as exc:  # noqa: BLE001 - a triton failure must not stop generation
            logger.warning("triton decode attention failed (%s); using torch's kernels", exc)
            CachedKVAttention.decode_kernel = "sdpa"
        rotated = rope_store_reference(query, *new[:4], key, value, new.slot)  # the slot is inside the view
        return self._fused_decode(rotated.unsqueeze(0), key, value, attention_mask)

    def _fused_prefill(self, query, key, value, attention_mask):
        """A prefill on a GPU: torch's fused attention kernel, blockwise, instead of materialising
        [b, heads, sq, slots] fp32 scores (at 256 prompts of 512 tokens, 3 GiB per layer)."""
        sq, b, heads, dim = query.shape
        groups, slots = key.size(1), key.size(2)
        if attention_mask is None and sq == slots:  # a prefill from slot 0, no padding: flash attention
            out = F.scaled_dot_product_attention(query.permute(1, 2, 0, 3), key, value, is_causal=True,
                                                 scale=self.softmax_scale, enable_gqa=heads != groups)
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)
        if attention_mask is None:
            attention_mask = trailing_causal_mask(sq, slots, query.device)
        allowed = ~attention_mask.expand(b, 1, sq, slots)
        # Queries end at the last slot. A left-padding query has no key to see, and some of torch's
        # fused kernels give such a row NaN: let every query see its own slot (what a padding
        # query computes is masked out of every real row).
        diagonal = torch.arange(sq, device=query.device)
        allowed[:, :, diagonal, diagonal + (slots - sq)] = True
        if heads != groups:  # the memory-efficient kernel takes no grouped keys: one copy per head
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
        out = F.scaled_dot_product_attention(query.permute(1, 2, 0, 3), key, value, attn_mask=allowed,
                                             scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


# The last decode step's (mask, additive bias): see decode_bias.
_decode_bias: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)


def _identity(norm) -> bool:
    """Whether a query or key norm slot holds no norm (megatron-core's specs put an ``IdentityOp``
    there, or None)."""
    return norm is None or isinstance(norm, IdentityOp)


def decode_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a decode step's mask (True: masked -> -inf, else 0), which the fused
    kernel reads as it is (a boolean mask it converts on every call). Every layer of a step gets
    the same mask tensor: the bias is made once per step, by the first layer, and reused while
    the mask is that same object."""
    global _decode_bias
    cached_mask, bias = _decode_bias
    if cached_mask is not mask or bias.dtype != dtype:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
        _decode_bias = (mask, bias)
    return bias


def trailing_causal_mask(queries: int, slots: int, device: torch.device) -> torch.Tensor:
    """[1, 1, queries, slots], True where masked: the queries are the last ``queries`` slots."""
    return torch.ones(queries, slots, dtype=torch.bool, device=device).triu(slots - queries + 1)[None, None]


def supports_kv_attention(config) -> bool:
    """Whether ``config``'s attention is one ``EngineSelfAttention`` computes exactly."""
    return (not config.multi_latent_attention and config.context_parallel_size == 1
            and getattr(config, "softmax_type", "vanilla") == "vanilla" and config.window_size is None
            and not config.attention_output_gate and not getattr(config, "no_rope_freq", None))


def use_kv_attention(spec) -> None:
    """Point a layer spec's (or a block spec's layers') self-attention at the engine's classes."""
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention
        attention.module = EngineSelfAttention
        attention.submodules.core_attention = CachedKVAttention
