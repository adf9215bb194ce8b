"""Causal core attention through torch's fused kernel, for the local (non-TransformerEngine) spec.

megatron-core's local ``DotProductAttention`` materialises the [b, heads, s, s] scores, fills the
masked half, softmaxes in a separate pass and multiplies again; on a CPU (and on a GPU without
TransformerEngine) that is most of the learner's attention time. When the mask is the plain
causal one (the learner passes no mask; the spec's mask type says causal), every row's attention
is ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``, which torch runs
blockwise without the s x s tensors (flash attention on CPU and GPU). The learner's train step
on the benchmark's batches at one CPU thread (``tools/bench/learner_step.py``, 2-120 digits):
0.243 s -> 0.180 s; on one H200 (Qwen2-1.5B shape, bf16, 100k tokens) 3.35 s -> 3.22 s, with
peak memory 102 -> 84 GiB.

A ``SegmentLayout`` in place of the mask (``learner.share_prompts``: a group's prompt once, its
responses after it) runs ``shared_prefix.segment_attention`` with the same kernel.

Right-padded rows stay exact under a causal mask: a real token never attends to a later slot,
and what the padding slots compute is masked out of every loss. Anything else (an explicit mask,
as the rollout engine passes; dropout while training; sliding windows, softmax offsets) takes
megatron-core's path unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from .shared_prefix import SegmentLayout, segment_attention


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Boolean [1, 1, s, s] mask, True where attention is not allowed (Megatron's convention).
    The learner passes none (the fused path); the rollout engine's prefill and tests do."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def fused_causal_supported(config, attention_dropout: float) -> bool:
    """Whether ``config``'s core attention is the plain softmax(QK^T * scale) V that the fused
    kernel computes (no window, no learned softmax offset, no dropout). Context parallelism
    needs no check: the local DotProductAttention refuses it."""
    return (attention_dropout == 0.0 and config.window_size is None
            and getattr(config, "softmax_type", "vanilla") == "vanilla")


class FusedCausalAttention(DotProductAttention):
    """``DotProductAttention`` that computes a causal mask-less call with the fused kernel."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dropout = self.attention_dropout.p
        self._fused = self.attn_mask_type == AttnMaskType.causal and fused_causal_supported(self.config, dropout)
        # Megatron divides softmax_scale by the layer number under query-key layer scaling and
        # its softmax multiplies the scores back: the net scale is this one.
        self._scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if isinstance(attention_mask, SegmentLayout):  # one row per GRPO group (shared_prefix.py)
            if not self._fused or attention_bias is not None or packed_seq_params is not None:
                raise ValueError("learner.share_prompts needs plain softmax attention (no dropout, window, "
                                 "softmax offset or bias); set learner.share_prompts=false")
            return segment_attention(query, key, value, attention_mask, self._scale)
        if (not self._fused or attention_mask is not None or attention_bias is not None
                or packed_seq_params is not None or query.size(0) != key.size(0)):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, b = query.shape[:2]
        # [s, b, heads, dim] -> [b, heads, s, dim]; key groups shared by consecutive query heads (GQA).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        grouped = q.size(1) != k.size(1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self._scale,
                                             enable_gqa=grouped)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def use_fused_causal_attention(spec) -> None:
    """Point a local layer spec's (or a block spec's layers') self-attention at
    ``FusedCausalAttention`` (in place; MLA layers get their own subclass of it afterwards)."""
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention
        if getattr(attention.submodules, "core_attention", None) is DotProductAttention:
            attention.submodules.core_attention = FusedCausalAttention
