"""Model families: what distinguishes one decoder architecture from another in the model build and
in Hugging Face's tensor names. Everything else (sizes, MoE counts) lives in ModelConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    # Hugging Face ``architectures[0]`` and ``model_type`` of this family.
    architecture: str
    model_type: str
    # Biases on the q/k/v projections only (Qwen2 family); no other linear layer has one.
    qkv_bias: bool
    # RMSNorm over each head's queries and keys before RoPE (Qwen3 family).
    qk_norm: bool
    # How HF names the routed experts: None (dense), "qwen" (mlp.gate, mlp.experts.E.{gate,up,down}_proj)
    # or "mixtral" (block_sparse_moe.gate, block_sparse_moe.experts.E.{w1,w3,w2}).
    moe_naming: Optional[str] = None
    # HF module name of the shared expert (Qwen2-MoE: one gated shared_expert; DeepSeek: shared_experts).
    shared_expert: str = "mlp.shared_expert"
    # Multi-head latent attention (DeepSeek-V3) instead of grouped-query attention.
    mla: bool = False


FAMILIES: Dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", qkv_bias=True, qk_norm=False, moe_naming="qwen"),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", qkv_bias=False, qk_norm=True, moe_naming="qwen"),
        Family("mixtral", "MixtralForCausalLM", "mixtral", qkv_bias=False, qk_norm=False, moe_naming="mixtral"),
        # qk_norm: MLA's RMSNorms on the compressed q and kv latents.
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", qkv_bias=False, qk_norm=True,
               moe_naming="qwen", shared_expert="mlp.shared_experts", mla=True),
    )
}

FAMILY_NAMES: Tuple[str, ...] = tuple(FAMILIES)


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_for_architecture(architecture: str) -> Family:
    """The family whose Hugging Face class is ``architecture`` (e.g. 'Qwen3ForCausalLM')."""
    for family in FAMILIES.values():
        if family.architecture == architecture:
            return family
    known = ", ".join(f.architecture for f in FAMILIES.values())
    raise ValueError(f"unsupported architecture {architecture!r}; supported: {known}")


def check_family(model_cfg) -> None:
    """model.family against the expert and attention keys it needs (ConfigError naming the fix)."""
    m = model_cfg
    family = get_family(m.family)
    if family.moe_naming and not m.num_experts:
        raise ConfigError(f"model.family={m.family} is a mixture of experts: set model.num_experts (e.g. 8)")
    if m.num_experts and not family.moe_naming:
        raise ConfigError(f"model.num_experts={m.num_experts} needs an MoE family (mixtral, qwen2_moe, qwen3_moe, "
                          f"deepseek_v3): model.family={m.family} has no Hugging Face layout for experts")
    if family.mla and m.kv_lora_rank is None:
        raise ConfigError("model.family=deepseek_v3 uses multi-head latent attention: set model.kv_lora_rank "
                          "(and q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), or use model.path")
