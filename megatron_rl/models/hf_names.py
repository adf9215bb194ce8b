"""Name and layout map between a full (unsharded: TP=PP=EP=1) Megatron GPTModel state dict and
Hugging Face tensors, for every family in ``families.py``.

Megatron fuses Q, K, V into one ``linear_qkv`` whose rows are grouped per KV head:
``[q_0 .. q_{n/g-1}, k, v]`` for each of the g query groups; HF keeps three matrices. Megatron
fuses a gated MLP's gate and up projections into ``linear_fc1`` as ``[gate; up]`` (dense MLPs,
each routed expert, the shared expert). The MoE router, per-head q/k norms and the shared
expert's sigmoid gate map one to one. Both the local layer spec (separate norm modules) and the
TransformerEngine spec (norm weights fused into the following linear) are understood.

Each Megatron tensor is built from a short list of HF tensors (``hf_sources``), so a converter can
read just those from disk, convert, and drop them: nothing needs the whole HF state at once.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, List, Sequence, Tuple

import torch

from ..config.schema import ModelConfig
from .families import get_family

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

# Megatron per-layer suffix -> HF per-layer suffix, for tensors that map one to one in every family.
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
# Megatron suffix -> HF (gate, up) suffixes of a fused gated-MLP input projection.
_FC1 = {
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# HF names of the router and of one routed expert's (gate, up, down) weights, per naming style.
_MOE_HF = {
    "qwen": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
             "mlp.experts.{e}.down_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}


def _qkv_split(cfg: ModelConfig) -> Tuple[int, int, int]:
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    q_per_group = cfg.num_attention_heads // cfg.num_query_groups
    return cfg.num_query_groups, q_per_group, head_dim


def split_qkv(fused: torch.Tensor, cfg: ModelConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, q_per_group, head_dim = _qkv_split(cfg)
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, (q_per_group + 2) * head_dim, *rest)
    q = grouped[:, : q_per_group * head_dim].reshape(-1, *rest)
    k = grouped[:, q_per_group * head_dim : (q_per_group + 1) * head_dim].reshape(-1, *rest)
    v = grouped[:, (q_per_group + 1) * head_dim :].reshape(-1, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    groups, q_per_group, head_dim = _qkv_split(cfg)
    rest = q.shape[1:]
    parts = (
        q.reshape(groups, q_per_group * head_dim, *rest),
        k.reshape(groups, head_dim, *rest),
        v.reshape(groups, head_dim, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def _layer_rule(suffix: str, cfg: ModelConfig) -> Tuple[str, Tuple[str, ...]]:
    """(kind, HF suffixes) for one per-layer Megatron suffix; kind is 'same', 'qkv' or 'fc1'."""
    if suffix in _DIRECT:
        return "same", (_DIRECT[suffix],)
    if suffix in _FC1:
        return "fc1", _FC1[suffix]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return "qkv", tuple(f"self_attn.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj"))
    naming = get_family(cfg.family).moe_naming
    if naming is not None:
        router, gate, up, down = _MOE_HF[naming]
        if suffix == "mlp.router.weight":
            return "same", (router,)
        match = _EXPERT.match(suffix)
        if match:
            e, which = match.groups()
            if which == "linear_fc1":
                return "fc1", (gate.format(e=e), up.format(e=e))
            return "same", (down.format(e=e),)
    raise KeyError(f"no Hugging Face name for Megatron tensor 'decoder.layers.N.{suffix}' (family {cfg.family})")


def _rule(name: str, cfg: ModelConfig) -> Tuple[str, Tuple[str, ...]]:
    if name in _TOP:
        return "same", (_TOP[name],)
    match = _LAYER.match(name)
    if not match:
        raise KeyError(f"no Hugging Face name for Megatron tensor {name!r}")
    layer, suffix = match.groups()
    kind, hf = _layer_rule(suffix, cfg)
    return kind, tuple(f"model.layers.{layer}.{s}" for s in hf)


def is_weight(name: str, cfg: ModelConfig) -> bool:
    """False for Megatron entries that carry no HF tensor: ``_extra_state``, a tied output layer."""
    if name.endswith("_extra_state"):
        return False
    return not (name == "output_layer.weight" and cfg.tie_word_embeddings)


def hf_sources(name: str, cfg: ModelConfig) -> List[str]:
    """The HF tensor names one full Megatron tensor is built from, in ``to_megatron``'s order."""
    return list(_rule(name, cfg)[1]) if is_weight(name, cfg) else []


def to_megatron(name: str, parts: Sequence[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The full Megatron tensor ``name`` from its HF ``parts`` (as listed by ``hf_sources``)."""
    kind, _ = _rule(name, cfg)
    if kind == "qkv":
        return fuse_qkv(*parts, cfg)
    if kind == "fc1":
        return torch.cat(list(parts), 0)
    return parts[0]


def megatron_to_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full Megatron tensor; ``_extra_state`` entries and a tied
    output layer yield nothing."""
    if not is_weight(name, cfg):
        return
    kind, hf = _rule(name, cfg)
    if kind == "qkv":
        yield from zip(hf, split_qkv(tensor, cfg))
    elif kind == "fc1":
        gate, up = torch.chunk(tensor, 2, dim=0)
        yield hf[0], gate.contiguous()
        yield hf[1], up.contiguous()
    else:
        yield hf[0], tensor


def hf_to_megatron(hf: Dict[str, torch.Tensor], megatron_names: Iterable[str],
                   cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Full Megatron tensors for the given Megatron names, built from a dict of HF tensors."""

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise KeyError(f"Hugging Face tensor {key!r} is missing")
        return hf[key]

    out: Dict[str, torch.Tensor] = {}
    for name in megatron_names:
        sources = hf_sources(name, cfg)
        if sources:
            out[name] = to_megatron(name, [take(s) for s in sources], cfg)
    return out
