"""Multi-head latent attention (DeepSeek-V3) on megatron-core's local layer spec.

megatron-core 0.16.1 builds MLA's core attention with ``k_channels``/``v_channels`` (queries and
keys are nope + rope dims wide, values v_head_dim), which only TransformerEngine's attention
accepts; the local ``DotProductAttention`` computes with whatever head sizes it is given but
sizes its output from ``kv_channels`` and takes no such arguments. This subclass takes them and
sizes the output from the value heads, so MLA runs without TransformerEngine (CPU included, and
the GPU machine, which has no TransformerEngine either).

The rollout engine's model (``build_gpt_model(..., kv_attention=True)``) gets
``EngineMLASelfAttention``: megatron-core's MLA with a decode step of static shapes, which the
engine replays from CUDA graphs (rollout/embedded/decode_graphs.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from .causal_attention import FusedCausalAttention


def fix_te_flag() -> None:
    """megatron-core 0.16.1's multi_latent_attention sets HAVE_TE when its TransformerEngine
    extension module imports, which it does without TransformerEngine (its classes are then mock
    placeholders), and later calls ``isinstance(linear_proj, TELinear)``: a TypeError. Clear the
    flag when TransformerEngine is not installed."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


class MLADotProductAttention(FusedCausalAttention):
    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            # [sq, b, heads, v_head_dim] -> [sq, b, heads * v_head_dim]
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


def use_local_mla_attention(block_spec) -> None:
    """Point every MLA layer of a local-spec block at MLADotProductAttention (in place)."""
    fix_te_flag()
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if getattr(attention.submodules, "linear_kv_down_proj", None) is not None:
            attention.submodules.core_attention = MLADotProductAttention


class EngineMLASelfAttention(MLASelfAttention):
    """megatron-core's MLA self-attention with a decode step of static shapes for the rollout
    engine (rollout/embedded/decode_graphs.py). Prefills and eager decode steps are megatron-core's
    own forward, unchanged: keys and values are cached in its layout ([slots, batch, heads, dim],
    the key's RoPE part rotated at its slot). Inside ``EngineKVContext.static_step`` the step:

    - projects the query and key as megatron-core does (q low-rank projection and layernorm, or
      one q projection; kv down projection, layernorm and up projection) and rotates their RoPE
      parts with the RoPE table's row at the step's slot, a device tensor (YaRN's mscale
      included);
    - writes the new key and value at that slot (``index_copy_``);
    - attends over the first ``static_width`` slots with the step's mask (slots after the new
      token and padding masked), at megatron-core's softmax scale (YaRN's mscale squared over
      sqrt(q head dim)).

    The cache is zero-initialised: a static step reads masked slots that were never written, and
    zero weight times uninitialised memory can be NaN."""

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dim, dtype):
        return super()._allocate_memory(inference_max_sequence_length, batch_size, dim, dtype).zero_()

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None,
                *, inference_params=None):
        from .kv_attention import EngineKVContext

        context = inference_context or inference_params
        if not isinstance(context, EngineKVContext) or context.static_slot is None:
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                   attention_bias, packed_seq_params, position_ids, sequence_len_offset,
                                   inference_params=inference_params)
        query, key, value = self._static_query_key_value(hidden_states, context)
        keys, values = self._static_cache(context, key, value)
        rows, width = key.size(1), context.static_width
        keys[:, :rows].index_copy_(0, context.static_slot, key)
        values[:, :rows].index_copy_(0, context.static_slot, value)
        out = static_decode_attention(query, keys[:width, :rows], values[:width, :rows], attention_mask,
                                      self.softmax_scale)
        return self.linear_proj(out)

    def _static_cache(self, context, key: torch.Tensor, value: torch.Tensor):
        """This layer's cache in megatron-core's layout (made as its forward makes it, if absent)."""
        if self.layer_number not in context.key_value_memory_dict:
            context.key_value_memory_dict[self.layer_number] = (
                self._allocate_memory(context.max_sequence_length, context.max_batch_size, self.key_hidden_size,
                                      key.dtype),
                self._allocate_memory(context.max_sequence_length, context.max_batch_size, self.val_hidden_size,
                                      value.dtype))
        return context.key_value_memory_dict[self.layer_number]

    def _rope_table(self, length: int):
        """(RoPE table [length, 1, 1, dim], mscale): what megatron-core's forward gets from the
        rotary module for a cache of ``length`` slots, held by the layer. The module caches its
        tables in one lru_cache of 32 entries shared by every instance (each MLA layer has its
        own module, and a learner in the same process adds its own): a table it drops would be
        freed while a captured graph still reads it by address."""
        held = getattr(self, "_held_rope_table", None)
        if held is None or held[0] != length:
            table, mscale = self.rotary_pos_emb(length, packed_seq=False), 1.0
            if self.config.rope_type != "rope":
                table, mscale = table
            held = self._held_rope_table = (length, table, mscale)
        return held[1], held[2]

    def _static_query_key_value(self, hidden_states: torch.Tensor, context):
        """megatron-core's ``get_query_key_value_tensors`` (no packing, no sequence or context
        parallelism, no fused RoPE, no cached latents) for one new token per row, its RoPE rows
        taken at the context's device-held slot instead of sliced at the Python offset.
        -> query, key [1, rows, heads, qk_head_dim + qk_pos_emb_head_dim], value [1, rows, heads,
        v_head_dim]."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        config = self.config
        table, mscale = self._rope_table(context.max_sequence_length)
        freqs = context.slot_rotary(table)
        if config.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            if q_compressed.size(-1) != config.q_lora_rank:
                q_compressed = gather_from_tensor_model_parallel_region(q_compressed)
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_compressed))
        else:
            q, _ = self.linear_q_proj(hidden_states)
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        if kv_combined.size(-1) != config.kv_lora_rank + config.qk_pos_emb_head_dim:
            kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(kv_compressed))
        heads = self.num_attention_heads_per_partition
        q = q.view(*q.size()[:-1], heads, self.q_head_dim)
        kv = kv.view(*kv.size()[:-1], heads, config.qk_head_dim + config.v_head_dim)
        q_no_pe, q_pos_emb = torch.split(q, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        k_no_pe, value = torch.split(kv, [config.qk_head_dim, config.v_head_dim], dim=-1)
        cp = self.pg_collection.cp
        q_pos_emb = apply_rotary_pos_emb(q_pos_emb, freqs, config=config, mscale=mscale, cp_group=cp)
        k_pos_emb = apply_rotary_pos_emb(k_pos_emb.unsqueeze(-2), freqs, config=config, mscale=mscale, cp_group=cp)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb.expand(-1, -1, heads, -1)], dim=-1)
        return query, key, value


def static_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """One new token per row over cached slots in megatron-core's layout: query [1, b, heads, dq],
    key [slots, b, heads, dq], value [slots, b, heads, dv], mask [b, 1, 1, slots] (True: masked;
    every row sees at least its new token's slot) -> [1, b, heads * dv]. On a GPU (or with
    ``CachedKVAttention.fused_on_cpu``) torch's fused kernel; else two batched matmuls and an
    fp32 softmax, as megatron-core's local attention computes them."""
    from .kv_attention import CachedKVAttention, decode_bias

    _, b, heads, _ = query.shape
    q = query.permute(1, 2, 0, 3)  # [b, heads, 1, dq]
    k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, heads, slots, d]
    if query.is_cuda or CachedKVAttention.fused_on_cpu:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=decode_bias(mask, q.dtype), scale=scale)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(mask, torch.finfo(q.dtype).min)
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
    return out.permute(2, 0, 1, 3).reshape(1, b, -1)


def supports_engine_mla(config) -> bool:
    """Whether ``config``'s multi-latent attention is what ``EngineMLASelfAttention``'s static step
    computes: unfused RoPE ("rope" or "yarn"), no cached latents, no sequence or context
    parallelism, no attention variant."""
    return (config.multi_latent_attention and not config.apply_rope_fusion and not config.cache_mla_latents
            and not config.sequence_parallel and config.context_parallel_size == 1
            and config.rope_type in ("rope", "yarn")
            and getattr(config, "experimental_attention_variant", None) is None
            and getattr(config, "softmax_type", "vanilla") == "vanilla")


def use_engine_mla(block_spec) -> None:
    """Point every MLA layer of a block spec at ``EngineMLASelfAttention`` (in place)."""
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention:
            attention.module = EngineMLASelfAttention
