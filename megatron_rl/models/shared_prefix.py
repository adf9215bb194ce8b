"""One forward row per GRPO group: the prompt once, then every response, each response attending
to the prompt and to itself only (segment attention).

A group of G samples shares its prompt. Trained as G rows of prompt + response, the prompt's
tokens go through every layer G times; here they go through once and the responses attend to
that one copy, so a group of prompt P and responses R_i costs P + ΣR_i tokens instead of
G·P + ΣR_i. What the model computes for each response token is unchanged: the same keys and
values before it (its prompt's and its own), the same positions. Gradients into the prompt are
the sum over the responses, as with G copies.

Two pieces make the layout exact:
- ``SegmentLayout``, given to the core attention in place of a mask: per segment (a prompt, or a
  response after its prompt), which flat token slots are its queries and its keys. Attention runs
  as one batched call over the segments (``segment_attention``), each padded only to the longest
  segment of the micro-batch, never over the whole row: a row holds G responses, and a dense mask
  over it would spend G times the attention work on blocks that are masked out.
- ``rotary_at``: rotary embeddings at each token's own position (a response continues at the end
  of its prompt, whatever its offset in the row). megatron-core computes RoPE for positions
  0..s-1 of the row and ignores ``position_ids``, so the model's rotary module answers with the
  given positions for the duration of the forward.

Supported: the local layer spec's attention (``causal_attention.FusedCausalAttention``) with
plain RoPE, no pipeline, context or expert parallelism (``unsupported`` says why not otherwise),
on a CPU. On CUDA the segment mask keeps SDPA off its flash kernel: on one H200 (Qwen2-1.5B
shape, bf16, 256 samples) a step took 8.4-10.2 s against 2.7-3.4 s on plain rows, so the learner
refuses it there until a varlen or block-sparse kernel (FlexAttention) takes the segments.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..errors import ConfigError


@dataclass
class SegmentLayout:
    """Which slots of a [rows, s] forward attend to which. Slots are flat, row-major
    (row · s + position); index ``rows · s`` is a zero slot that pads segments."""

    q_index: torch.Tensor   # [segments, Lq] each segment's query slots (padded)
    k_index: torch.Tensor   # [segments, Lk] its key slots: prompt (for a response), then its own
    allowed: torch.Tensor   # [segments, 1, Lq, Lk] True where a query may attend to a key
    q_valid: torch.Tensor   # [segments, Lq] True for real (not padding) queries
    q_dest: torch.Tensor    # [real queries] the flat slot of each real query, in q_valid's order
    slots: int              # rows · s

    def to(self, device: torch.device) -> "SegmentLayout":
        return SegmentLayout(*(getattr(self, f).to(device) for f in ("q_index", "k_index", "allowed", "q_valid",
                                                                      "q_dest")), self.slots)


def build_segment_layout(segments: Sequence[Tuple[List[int], List[int]]], slots: int) -> SegmentLayout:
    """``segments``: (prefix slots, own slots) per segment: a prompt is ([], its slots), a
    response (its prompt's slots, its slots). Own slots attend causally among themselves and to
    the whole prefix."""
    n = len(segments)
    lq = max(len(own) for _, own in segments)
    lk = max(len(pre) + len(own) for pre, own in segments)
    q_index = torch.full((n, lq), slots, dtype=torch.long)
    k_index = torch.full((n, lk), slots, dtype=torch.long)
    prefix = torch.tensor([len(pre) for pre, _ in segments])
    own = torch.tensor([len(o) for _, o in segments])
    for i, (pre, mine) in enumerate(segments):
        q_index[i, : len(mine)] = torch.tensor(mine)
        k_index[i, : len(pre) + len(mine)] = torch.tensor(pre + mine)
    q = torch.arange(lq)[None, :, None]
    k = torch.arange(lk)[None, None, :]
    p, r = prefix[:, None, None], own[:, None, None]
    allowed = (k < p) | ((k >= p) & (k - p <= q))
    q_valid = torch.arange(lq)[None, :] < own[:, None]
    # A padding query attends to its segment's first key (always real): a row with no key at all
    # would softmax to NaN, and NaN times the zero gradient of a discarded output is still NaN.
    allowed = torch.where(q < r, allowed, k == 0)
    return SegmentLayout(q_index, k_index, allowed[:, None], q_valid, q_index[q_valid], slots)


def take_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` for an integer ``index`` of any shape, through index_select: the same
    values, but its backward adds repeated rows (a prompt's keys, read by every response of the
    group) in a fixed order. Advanced indexing's backward on a multi-threaded CPU adds them in
    whatever order the threads reach them, so two runs of one seed drifted apart at ~1e-8."""
    return source.index_select(0, index.reshape(-1)).view(*index.shape, *source.shape[1:])


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SegmentLayout,
                      scale: float) -> torch.Tensor:
    """Core attention of a segment layout: [s, b, heads, dim] inputs -> [s, b, heads · dim]."""
    s, b = query.shape[:2]

    def by_slot(t: torch.Tensor) -> torch.Tensor:  # [b·s + 1, heads, dim], the last slot zero
        flat = t.transpose(0, 1).reshape(b * s, t.shape[2], t.shape[3])
        return torch.cat([flat, flat.new_zeros(1, t.shape[2], t.shape[3])])

    q = take_rows(by_slot(query), layout.q_index).transpose(1, 2)  # [segments, heads, Lq, dim]
    k = take_rows(by_slot(key), layout.k_index).transpose(1, 2)
    v = take_rows(by_slot(value), layout.k_index).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.allowed, scale=scale,
                                         enable_gqa=q.size(1) != k.size(1))
    real = out.transpose(1, 2)[layout.q_valid]  # [real queries, heads, dim]
    flat = real.new_zeros(b * s, real.shape[1], real.shape[2]).index_copy(0, layout.q_dest, real)
    return flat.view(b, s, -1).transpose(0, 1)


@contextmanager
def rotary_at(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """During the block, the model's RoPE is taken at ``positions`` [b, s] instead of 0..s-1."""
    from megatron.core.utils import unwrap_model  # DDP, Float16Module; imported here to keep config checks light

    rope = getattr(unwrap_model(model), "rotary_pos_emb", None)
    if rope is None:
        yield
        return

    def at_positions(*args, **kwargs) -> torch.Tensor:
        # As RotaryEmbedding.get_emb, at given positions: [s, b, 1, dim] broadcasts over heads.
        seq = positions.t().to(rope.inv_freq.dtype)
        if rope.seq_len_interpolation_factor is not None:
            seq = seq * (1 / rope.seq_len_interpolation_factor)
        freqs = seq[..., None] * rope.inv_freq
        if rope.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).view(*freqs.shape[:-1], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, :, None, :]

    rope.forward = at_positions
    try:
        yield
    finally:
        del rope.forward


def unsupported(model_cfg, learner_cfg) -> List[str]:
    """What in the config keeps ``learner.share_prompts`` from working (empty: nothing). The
    learner also refuses it on a GPU (see the module's docstring)."""
    reasons = []
    if learner_cfg.pp > 1:
        reasons.append("learner.pp > 1 (pipeline stages exchange one activation shape per micro-batch)")
    if learner_cfg.cp > 1:
        reasons.append("learner.cp > 1")
    if learner_cfg.ep > 1:
        reasons.append("learner.ep > 1 (expert parallelism uses uniform micro-batches)")
    if model_cfg.kv_lora_rank is not None:
        reasons.append("multi-head latent attention (model.kv_lora_rank)")
    return reasons


def check_share_prompts(cfg) -> None:
    """learner.share_prompts=true only where the shared-prefix forward can run (``unsupported``)."""
    if cfg.learner.share_prompts and (reasons := unsupported(cfg.model, cfg.learner)):
        raise ConfigError("learner.share_prompts=true is not supported with " + "; ".join(reasons)
                          + ": set learner.share_prompts=false")
