"""Name and layout map between a full (unsharded) Megatron GPTModel state dict and Hugging Face
Llama / Qwen2 tensors.

Megatron fuses Q, K, V into one ``linear_qkv`` whose rows are grouped per KV head:
``[q_0 .. q_{n/g-1}, k, v]`` for each of the g query groups; HF keeps three matrices. Megatron
fuses the gated MLP's gate and up projections into ``linear_fc1`` as ``[gate; up]``.
Both the local layer spec (separate norm modules) and the TransformerEngine spec (norm weights
fused into the following linear) are understood.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, Tuple

import torch

from ..config.schema import ModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> HF per-layer suffix, for tensors that map one to one.
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _qkv_split(cfg: ModelConfig) -> Tuple[int, int, int]:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
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


def megatron_to_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full Megatron tensor; ``_extra_state`` entries yield nothing."""
    if name.endswith("_extra_state"):
        return
    if name in _TOP:
        if name == "output_layer.weight" and cfg.tie_word_embeddings:
            return
        yield _TOP[name], tensor
        return
    match = _LAYER.match(name)
    if not match:
        raise KeyError(f"no Hugging Face name for Megatron tensor {name!r}")
    layer, suffix = match.groups()
    prefix = f"model.layers.{layer}."
    if suffix in _DIRECT:
        yield prefix + _DIRECT[suffix], tensor
    elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), split_qkv(tensor, cfg)):
            yield f"{prefix}self_attn.{proj}.{kind}", part
    elif suffix == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        yield prefix + "mlp.gate_proj.weight", gate.contiguous()
        yield prefix + "mlp.up_proj.weight", up.contiguous()
    else:
        raise KeyError(f"no Hugging Face name for Megatron tensor {name!r}")


def hf_to_megatron(hf: Dict[str, torch.Tensor], megatron_names: Iterator[str],
                   cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Full Megatron tensors for the given Megatron names, built from a dict of HF tensors."""

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise KeyError(f"Hugging Face tensor {key!r} is missing")
        return hf[key]

    out: Dict[str, torch.Tensor] = {}
    for name in megatron_names:
        if name.endswith("_extra_state"):
            continue
        if name in _TOP:
            out[name] = take(_TOP[name])
            continue
        match = _LAYER.match(name)
        if not match:
            raise KeyError(f"no Hugging Face source for Megatron tensor {name!r}")
        layer, suffix = match.groups()
        prefix = f"model.layers.{layer}."
        if suffix in _DIRECT:
            out[name] = take(prefix + _DIRECT[suffix])
        elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            q, k, v = (take(f"{prefix}self_attn.{p}.{kind}") for p in ("q_proj", "k_proj", "v_proj"))
            out[name] = fuse_qkv(q, k, v, cfg)
        elif suffix == "mlp.linear_fc1.weight":
            out[name] = torch.cat([take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight")], 0)
        else:
            raise KeyError(f"no Hugging Face source for Megatron tensor {name!r}")
    return out
