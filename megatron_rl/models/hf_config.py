"""Hugging Face ``config.json`` <-> our ModelConfig (plus the vocabulary size, which ModelConfig does
not hold: the trainer takes it from the tokenizer).

Read without transformers: a checkpoint directory is plain JSON + safetensors. Both the
transformers 4 spelling (``rope_theta``, ``rope_scaling``) and the 5 spelling (``rope_parameters``)
are understood. Anything our Megatron build would compute differently is refused with the key
named, rather than converted into a model that silently disagrees with the original.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..config.schema import ModelConfig
from .families import Family, family_for_architecture, get_family
from ..errors import UserError

# Llama-3 RoPE scaling keys of config.json -> ModelConfig fields (the frequency table is built from
# them in models/rope.py), with transformers' defaults.
_LLAMA3_ROPE_KEYS = {"low_freq_factor": ("rope_low_freq_factor", 1.0),
                     "high_freq_factor": ("rope_high_freq_factor", 4.0),
                     "original_max_position_embeddings": ("rope_original_max_position_embeddings", 8192)}


class UnsupportedConfigError(UserError):
    """A config.json our model build cannot reproduce exactly; the message names the key."""


def read_hf_config(path: Path | str) -> Dict[str, Any]:
    """The parsed ``config.json`` of an HF checkpoint directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: an HF checkpoint directory holds config.json + *.safetensors")
    return json.loads(file.read_text())


def hf_family(hf: Dict[str, Any]) -> Family:
    archs = hf.get("architectures") or []
    if not archs:
        raise UnsupportedConfigError("config.json has no 'architectures' entry; cannot tell the model family")
    try:
        return family_for_architecture(archs[0])
    except ValueError as err:
        raise UnsupportedConfigError(str(err)) from None


def _rope_params(hf: Dict[str, Any]) -> Dict[str, Any]:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    return {**scaling, **params}


def _rope(hf: Dict[str, Any], allow_yarn: bool = False) -> Tuple[float, Optional[float], Dict[str, Any]]:
    """(rope theta, Llama-3 scaling factor or None, the other Llama-3 ModelConfig fields) from
    either config spelling."""
    params = _rope_params(hf)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default" or (rope_type == "yarn" and allow_yarn):
        return float(theta), None, {}
    if rope_type == "llama3":
        fields = {field: type(default)(params.get(key, default)) for key, (field, default) in _LLAMA3_ROPE_KEYS.items()}
        return float(theta), float(params["factor"]), fields
    raise UnsupportedConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported "
                                 f"(default, llama3{', yarn' if allow_yarn else ''})")


def _refuse(hf: Dict[str, Any], key: str, ok: Any, why: str) -> None:
    value = hf.get(key, ok)
    if value != ok and not (value is None and ok is False):
        raise UnsupportedConfigError(f"config.json {key}={value!r} is not supported: {why}")


def _moe_pattern(hf: Dict[str, Any], layers: int) -> Optional[List[int]]:
    """Qwen-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) as a 0/1 pattern."""
    only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    pattern = [0 if (i in only or (i + 1) % step) else 1 for i in range(layers)]
    return None if all(pattern) else pattern


def _deepseek(hf: Dict[str, Any], cfg: ModelConfig) -> None:
    """DeepSeek-V3: multi-head latent attention, YaRN RoPE, sigmoid group-limited routing with an
    expert bias and a scaling factor, shared experts, the first layers dense."""
    if not hf.get("rope_interleave", True):
        raise UnsupportedConfigError("config.json rope_interleave=false is not supported: Megatron's MLA applies "
                                     "RoPE to interleaved pairs")
    if not hf.get("norm_topk_prob", True):
        raise UnsupportedConfigError("config.json norm_topk_prob=false is not supported: Megatron's sigmoid "
                                     "router always renormalises the top-k weights")
    _refuse(hf, "scoring_func", "sigmoid", "DeepSeek-V3 routing is sigmoid")
    cfg.q_lora_rank = int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None
    cfg.kv_lora_rank = int(hf["kv_lora_rank"])
    cfg.qk_nope_head_dim = int(hf["qk_nope_head_dim"])
    cfg.qk_rope_head_dim = int(hf["qk_rope_head_dim"])
    cfg.v_head_dim = int(hf["v_head_dim"])
    cfg.head_dim = None
    rope = _rope_params(hf)
    if rope.get("rope_type", rope.get("type")) == "yarn":
        cfg.yarn_factor = float(rope["factor"])
        cfg.yarn_original_max_position_embeddings = int(rope.get("original_max_position_embeddings", 4096))
        cfg.yarn_beta_fast = float(rope.get("beta_fast", 32))
        cfg.yarn_beta_slow = float(rope.get("beta_slow", 1))
        cfg.yarn_mscale = float(rope.get("mscale", 1))
        cfg.yarn_mscale_all_dim = float(rope.get("mscale_all_dim", 0))
    cfg.num_experts = int(hf["n_routed_experts"])
    cfg.moe_router_topk = int(hf["num_experts_per_tok"])
    cfg.moe_ffn_hidden_size = int(hf["moe_intermediate_size"])
    cfg.moe_norm_topk_prob = True
    dense = int(hf.get("first_k_dense_replace", 0))
    step = int(hf.get("moe_layer_freq", 1) or 1)
    pattern = [0 if (i < dense or i % step) else 1 for i in range(cfg.num_layers)]
    cfg.moe_layer_pattern = None if all(pattern) else pattern
    cfg.moe_shared_expert_ffn_hidden_size = int(hf.get("n_shared_experts") or 0) * cfg.moe_ffn_hidden_size
    cfg.moe_shared_expert_gate = False
    cfg.moe_router_score_function = "sigmoid"
    cfg.moe_router_expert_bias = True
    cfg.moe_router_num_groups = int(hf.get("n_group") or 1)
    cfg.moe_router_group_topk = int(hf.get("topk_group") or 1)
    cfg.moe_router_topk_scaling_factor = float(hf.get("routed_scaling_factor", 1.0))


def model_config_from_hf(hf: Dict[str, Any], dtype: str = "fp32") -> Tuple[ModelConfig, int]:
    """(ModelConfig, vocab size) equivalent to an HF ``config.json`` dict."""
    family = hf_family(hf)
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise UnsupportedConfigError(f"config.json quantization_config (quant_method={method!r}) is not supported: "
                                     "dequantize the checkpoint to bf16 first")
    _refuse(hf, "hidden_act", "silu", "only SwiGLU MLPs (silu) are built")
    _refuse(hf, "mlp_bias", False, "MLP biases are not built")
    _refuse(hf, "use_sliding_window", False, "sliding-window attention is not built")
    if family.name in ("llama", "mixtral") and hf.get("sliding_window"):
        raise UnsupportedConfigError(f"config.json sliding_window={hf['sliding_window']} is not supported: "
                                     "sliding-window attention is not built")
    bias_key = "qkv_bias" if family.name == "qwen2_moe" else "attention_bias"
    if bool(hf.get(bias_key, family.qkv_bias)) != family.qkv_bias:
        raise UnsupportedConfigError(f"config.json {bias_key}={hf[bias_key]} is not supported for "
                                     f"{family.architecture} (q/k/v biases: {family.qkv_bias})")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedConfigError(f"config.json partial_rotary_factor={hf['partial_rotary_factor']} is not supported")
    theta, rope_factor, llama3_rope = _rope(hf, allow_yarn=family.mla)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim")
    cfg = ModelConfig(
        family=family.name,
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        head_dim=int(head_dim) if head_dim and int(head_dim) != hidden // heads else None,
        rotary_base=theta,
        rope_scaling_factor=rope_factor,
        **llama3_rope,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        dtype=dtype,
    )
    if family.mla:
        _deepseek(hf, cfg)
    elif family.moe_naming:
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        cfg.num_experts = int(experts)
        cfg.moe_router_topk = int(hf["num_experts_per_tok"])
        cfg.moe_ffn_hidden_size = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        # Mixtral always renormalises the top-k weights; the Qwen MoEs say so in norm_topk_prob.
        cfg.moe_norm_topk_prob = True if family.name == "mixtral" else bool(hf.get("norm_topk_prob", False))
        cfg.moe_layer_pattern = _moe_pattern(hf, cfg.num_layers)
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        cfg.moe_shared_expert_ffn_hidden_size = shared
        cfg.moe_shared_expert_gate = shared > 0  # Qwen2-MoE gates its shared expert
    return cfg, int(hf["vocab_size"])


def hf_config_from_model(cfg: ModelConfig, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """An HF ``config.json`` dict for ``cfg``. ``base`` (e.g. the original checkpoint's config) keeps
    the keys we do not model (token ids, chat settings); the architecture keys are overwritten."""
    family = get_family(cfg.family)
    out: Dict[str, Any] = dict(base or {})
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    rope: Dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_type": "default"}
    if cfg.rope_scaling_factor is not None:
        rope = {"rope_theta": cfg.rotary_base, "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                **{key: getattr(cfg, field) for key, (field, _) in _LLAMA3_ROPE_KEYS.items()}}
    out.pop("rope_scaling", None)
    out.update(
        architectures=[family.architecture],
        model_type=family.model_type,
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        rope_parameters=rope,
        # transformers 4 reads these two; 5 reads rope_parameters.
        rope_theta=cfg.rotary_base,
        tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu",
        initializer_range=cfg.init_method_std,
        dtype="bfloat16" if cfg.dtype == "bf16" else "float32",
    )
    if cfg.rope_scaling_factor is not None:
        out["rope_scaling"] = rope
    if family.name == "qwen2_moe":
        out["qkv_bias"] = True
    else:
        out["attention_bias"] = family.qkv_bias
    if family.mla:
        _deepseek_out(cfg, out)
    elif family.moe_naming:
        pattern = cfg.moe_layer_pattern or [1] * cfg.num_layers
        out.update(num_experts_per_tok=cfg.moe_router_topk,
                   norm_topk_prob=cfg.moe_norm_topk_prob)
        if family.name == "mixtral":
            out["num_local_experts"] = cfg.num_experts
            if cfg.moe_ffn_hidden_size not in (None, cfg.ffn_hidden_size) or not all(pattern):
                raise UnsupportedConfigError("Mixtral has no dense layers and experts of intermediate_size")
        else:
            out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                       decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
        if family.name == "qwen2_moe":
            out["shared_expert_intermediate_size"] = cfg.moe_shared_expert_ffn_hidden_size
    return out


def _deepseek_out(cfg: ModelConfig, out: Dict[str, Any]) -> None:
    """The DeepSeek-V3 keys of ``hf_config_from_model``."""
    if cfg.yarn_factor:
        out["rope_parameters"] = {"rope_theta": cfg.rotary_base, "rope_type": "yarn", "factor": cfg.yarn_factor,
                                  "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
                                  "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                                  "mscale": cfg.yarn_mscale, "mscale_all_dim": cfg.yarn_mscale_all_dim}
    pattern = cfg.moe_layer_pattern or [1] * cfg.num_layers
    dense = pattern.index(1) if 1 in pattern else cfg.num_layers
    if any(pattern[dense:]) and not all(pattern[dense:]):
        raise UnsupportedConfigError("DeepSeek-V3 has dense layers only before the first MoE layer")
    shared = cfg.moe_shared_expert_ffn_hidden_size // (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)
    out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
               qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
               qk_head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, head_dim=cfg.qk_rope_head_dim,
               rope_interleave=True, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
               moe_intermediate_size=cfg.moe_ffn_hidden_size, first_k_dense_replace=dense, moe_layer_freq=1,
               n_shared_experts=shared, n_group=cfg.moe_router_num_groups, topk_group=cfg.moe_router_group_topk,
               routed_scaling_factor=cfg.moe_router_topk_scaling_factor, norm_topk_prob=True, scoring_func="sigmoid",
               topk_method="noaux_tc")
