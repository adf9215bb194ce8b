"""Tiny random Hugging Face models for conversion tests, built from config objects (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)

# Every family with the features that distinguish it switched on: Llama-3 RoPE scaling, Qwen2
# q/k/v biases and tied embeddings, Qwen3 head_dim != hidden/heads with q/k norms, Qwen3-MoE with
# a dense layer and renormalised top-k, Mixtral, Qwen2-MoE with a gated shared expert.
FAMILY_CONFIGS: Dict[str, Dict] = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}, rope_theta=500000.0),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=True, mlp_only_layers=[0]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40),
}


def hf_config(family: str, **overrides):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
           "qwen2_moe": transformers.Qwen2MoeConfig}[family]
    return cls(**{**_COMMON, **FAMILY_CONFIGS[family], **overrides})


def save_random_hf_model(family: str, path: Path, seed: int = 0, **overrides):
    """A random fp32 model of ``family`` saved to ``path``; returns the (eval-mode) model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        # Norm weights start at exactly 1 and the router/gate at 0 or tiny values in some
        # families: randomise every tensor so a mix-up of two tensors cannot go unnoticed.
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    model.eval().save_pretrained(path)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits
