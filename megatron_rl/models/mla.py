"""Multi-head latent attention (DeepSeek-V3) on megatron-core's local layer spec.

megatron-core 0.16.1 builds MLA's core attention with ``k_channels``/``v_channels`` (queries and
keys are nope + rope dims wide, values v_head_dim), which only TransformerEngine's attention
accepts; the local ``DotProductAttention`` computes with whatever head sizes it is given but
sizes its output from ``kv_channels`` and takes no such arguments. This subclass takes them and
sizes the output from the value heads, so MLA runs without TransformerEngine (CPU included, and
the GPU machine, which has no TransformerEngine either).
"""

from __future__ import annotations

from typing import Optional

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
