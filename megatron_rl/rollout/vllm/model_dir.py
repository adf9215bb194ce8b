"""A Hugging Face model directory for our ModelConfig, so vLLM builds exactly our architecture.

``config.json`` is written from ``ModelConfig`` (llama / qwen2 families: RMSNorm, SwiGLU, RoPE,
q/k/v biases for qwen2); the weights, when given, go to ``model.safetensors`` under HF names
(``models/hf_names.py`` maps Megatron's). No vLLM import here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from ...config.schema import ModelConfig

_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def hf_config(cfg: ModelConfig, vocab_size: int) -> Dict[str, Any]:
    """The HF config.json dict of ``cfg`` with ``vocab_size`` (the learner's padded vocabulary)."""
    if cfg.family not in _ARCH:
        raise ValueError(f"model.family={cfg.family!r}: the vLLM engine knows {', '.join(_ARCH)}")
    arch, model_type = _ARCH[cfg.family]
    out: Dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": cfg.rotary_base,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "bfloat16" if cfg.dtype == "bf16" else "float32",
        # Token ids only: stops come with each request, never from the config.
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if cfg.family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return out


def write_model_dir(path: Path, cfg: ModelConfig, vocab_size: int,
                    named_tensors: Optional[Iterable[Tuple[str, torch.Tensor]]] = None) -> Path:
    """Write config.json (and model.safetensors when ``named_tensors`` is given) under ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(cfg, vocab_size), indent=2))
    (path / "generation_config.json").write_text(json.dumps({"_from_model_config": True}))
    if named_tensors is not None:
        tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in named_tensors}
        save_file(tensors, str(path / "model.safetensors"))
    return path
