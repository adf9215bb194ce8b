"""Build a Megatron-core GPTModel (llama, qwen2, qwen3 and their MoE forms) from our ModelConfig.

The learner and the embedded rollout engine both build their model here, so their forwards are the
same code and their logprobs agree.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from ..config.schema import ModelConfig
from .cpu_patches import apply_cpu_patches, cuda_available
from .families import get_family
from .residual_in_matmul import residual_in_matmul_without_grad
from .rms_norm import triton_norms_without_grad
from .rope import use_llama3_rope
from .thread_safety import make_thread_safe

logger = logging.getLogger(__name__)

def padded_vocab_size(vocab_size: int, tp: int = 1, multiple: int = 8) -> int:
    """Megatron shards the vocabulary over TP ranks: pad it to a multiple of ``multiple * tp``."""
    step = multiple * tp
    return ((vocab_size + step - 1) // step) * step


def te_available() -> bool:
    if not cuda_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def moe_kwargs(cfg: ModelConfig) -> Dict[str, Any]:
    """TransformerConfig fields for a mixture-of-experts model (empty for a dense one)."""
    if not cfg.num_experts:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        # Megatron's "pre-softmax" is softmax over all experts before top-k with no renormalisation;
        # without it the softmax runs over the k chosen logits, which equals renormalised top-k.
        moe_router_pre_softmax=not cfg.moe_norm_topk_prob,
        moe_layer_freq=list(cfg.moe_layer_pattern) if cfg.moe_layer_pattern is not None else 1,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher,
        moe_router_score_function=cfg.moe_router_score_function,
        moe_router_enable_expert_bias=cfg.moe_router_expert_bias,
        moe_router_num_groups=cfg.moe_router_num_groups,
        moe_router_group_topk=cfg.moe_router_group_topk,
        moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
        # Sigmoid routing (DeepSeek) scores in fp32, as the reference implementation does.
        moe_router_dtype="fp32" if cfg.moe_router_score_function == "sigmoid" else None,
        # megatron-core's GroupedMLP needs the grouped_gemm CUDA extension: the local spec keeps
        # SequentialMLP's per-expert weights and models/grouped_moe.py runs them grouped.
        moe_grouped_gemm=False,
    )


def mla_kwargs(cfg: ModelConfig) -> Dict[str, Any]:
    """MLATransformerConfig fields for multi-head latent attention (empty without it)."""
    if cfg.kv_lora_rank is None:
        return {}
    return dict(
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_type="yarn" if cfg.yarn_factor else "rope",
        rotary_base=cfg.rotary_base,
        # Also the softmax scale's mscale argument: 1.0 leaves the scale at 1/sqrt(head dim).
        rotary_scaling_factor=cfg.yarn_factor or 1.0,
        original_max_position_embeddings=cfg.yarn_original_max_position_embeddings,
        beta_fast=cfg.yarn_beta_fast,
        beta_slow=cfg.yarn_beta_slow,
        mscale=cfg.yarn_mscale,
        mscale_all_dim=cfg.yarn_mscale_all_dim,
    )


def recompute_kwargs(recompute: bool) -> Dict[str, Any]:
    """TransformerConfig fields for full activation recompute, one layer per checkpoint."""
    if not recompute:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def transformer_config(cfg: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1, initialize: bool = True,
                       recompute: bool = False):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    on_cpu = not cuda_available()
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    family = get_family(cfg.family)
    config_class = MLATransformerConfig if cfg.kv_lora_rank is not None else TransformerConfig
    return config_class(
        # Megatron's default ("full") is deprecated and warns at every build; [] means the same.
        cuda_graph_scope=[],
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        params_dtype=dtype,
        bf16=cfg.dtype == "bf16",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        pipeline_dtype=dtype,
        use_cpu_initialization=on_cpu,
        # Off when every weight is about to be loaded (conversion): random init of a large model
        # on CPU takes minutes and its values are overwritten anyway.
        perform_initialization=initialize,
        # Fusions need CUDA kernels; the unfused paths are exact and run anywhere. SwiGLU's fusion
        # is megatron-core's torch.compile'd function (no TransformerEngine); the rest need TE/apex.
        bias_activation_fusion=not on_cpu and cfg.fused_kernels,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        batch_p2p_sync=not on_cpu,
        # Losses are summed per token; Megatron divides gradients by the global token count.
        calculate_per_token_loss=True,
        **moe_kwargs(cfg),
        **mla_kwargs(cfg),
        **recompute_kwargs(recompute),
    )


def layer_spec(use_te: bool, qk_layernorm: bool = False):
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)


def decoder_spec(config, use_te: bool, kv_attention: bool = False, grouped_experts: bool = True):
    """The layer spec for a dense model; for MoE, a block spec with a dense or MoE spec per layer
    (``moe_layer_freq``), sliced to this pipeline stage's layers. ``kv_attention``: the rollout
    engine's KV-cache attention (models/kv_attention.py) where the model's attention allows it.
    ``grouped_experts``: MoE layers run their experts as grouped matmuls (models/grouped_moe.py)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if not config.num_moe_experts and not config.multi_latent_attention:
        spec = layer_spec(use_te, config.qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                          normalization="RMSNorm")
    if not use_te:
        from .causal_attention import use_fused_causal_attention
        from .mla import use_local_mla_attention

        use_fused_causal_attention(spec)
        if config.multi_latent_attention:
            use_local_mla_attention(spec)
        if config.num_moe_experts and grouped_experts:
            from .grouped_moe import use_grouped_experts

            use_grouped_experts(spec)
    if kv_attention:
        from .kv_attention import supports_kv_attention, use_kv_attention

        if supports_kv_attention(config):
            use_kv_attention(spec)
        elif config.multi_latent_attention:
            from .mla import supports_engine_mla, use_engine_mla

            if supports_engine_mla(config):
                use_engine_mla(spec)  # its decode step with static shapes
    return spec


def build_gpt_model(cfg: ModelConfig, vocab_size: int, tp: int = 1, pp: int = 1,
                    pre_process: Optional[bool] = None, post_process: Optional[bool] = None, ep: int = 1,
                    initialize: bool = True, kv_attention: bool = False, recompute: bool = False):
    """A GPTModel on this machine's device; parallel_state must already be initialised.
    ``kv_attention``: built for the rollout engine's KV cache (see models/kv_attention.py).
    ``recompute``: recompute activations in the backward (``learner.recompute_activations``).

    Under a pipeline (pp > 1) this rank's stage decides, unless given: only the first stage
    embeds tokens and only the last computes logits."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = pp == 1 or parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = pp == 1 or parallel_state.is_pipeline_last_stage()
    apply_cpu_patches()
    make_thread_safe()
    use_te = te_available()
    if cfg.num_experts and not use_te:
        _router_gemm_without_te()
    logger.debug("building GPTModel (%s spec)", "TransformerEngine" if use_te else "local")
    config = transformer_config(cfg, tp, pp, ep, initialize, recompute)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(config, use_te, kv_attention, cfg.moe_grouped_experts),
        vocab_size=vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rotary_base),
    )
    if cfg.rope_scaling_factor is not None:
        # Llama 3's frequency scaling, our table: Megatron's (rope_scaling=True) fixes the low/high
        # frequency factors and the original context at 1, 4 and 8192.
        use_llama3_rope(model, cfg)
    norms_in_model_dtype(model, config.params_dtype)
    if kv_attention:
        bias_in_matmul_without_grad(model)
        residual_in_matmul_without_grad(model)
        triton_norms_without_grad(model)
    if post_process and not config.sequence_parallel:
        batch_major_logits(model.output_layer)
    if cuda_available():
        from .compiled_rope import compiled_calls_beside_tracing, memoize_rotary_per_forward, use_compiled_rope

        compiled_calls_beside_tracing()
        if cfg.fused_kernels:
            use_compiled_rope()
            memoize_rotary_per_forward(model)
        model = model.cuda(torch.cuda.current_device())
    if kv_attention and cfg.num_experts:
        # The engine only runs forwards: its experts' weights stay stacked for the grouped matmuls.
        from .grouped_moe import stack_expert_weights

        stack_expert_weights(model)
    return model


def batch_major_logits(output_layer: torch.nn.Module) -> None:
    """Make the LM head write its logits batch-major. GPTModel returns ``logits.transpose(0, 1)
    .contiguous()`` ([s, b, V] -> [b, s, V]): with a 152k vocabulary that copy moves 10 GB per
    16k tokens, and its backward another 10 GB. The head here multiplies the (small) hidden
    states in [b, s, h] order and returns its [b, s, V] output as an [s, b, V] view, so the
    transpose gives back a contiguous tensor and the copy does nothing. Not under sequence
    parallelism, whose head gathers its input along the sequence axis."""
    output_layer.register_forward_pre_hook(_hidden_batch_major)
    output_layer.register_forward_hook(_logits_sequence_major_view)


def _hidden_batch_major(module, args):
    return (args[0].transpose(0, 1).contiguous(), *args[1:])


def _logits_sequence_major_view(module, args, output):
    logits, bias = output
    return logits.transpose(0, 1), bias


def bias_in_matmul_without_grad(model: torch.nn.Module) -> None:
    """In the rollout engine's forwards (no autograd), a column-parallel layer with a bias (Qwen2's
    query/key/value projection) adds it in the matmul's epilogue (``F.linear``) instead of in a
    kernel of its own after it, as megatron-core's linear function does: one kernel fewer per
    layer, and at 256 prompts of 512 tokens 20 ms of a 650 ms prefill's kernels on an H200. With
    autograd on, or under sequence parallelism, megatron-core's function runs as before."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear) and module.bias is not None and not module.skip_bias_add:
            module._forward_impl = functools.partial(_linear_without_grad, module._forward_impl)


def _linear_without_grad(default, input, weight, bias=None, sequence_parallel=False, **kwargs):
    if bias is None or sequence_parallel or torch.is_grad_enabled():
        return default(input=input, weight=weight, bias=bias, sequence_parallel=sequence_parallel, **kwargs)
    return F.linear(input, weight, bias)


def norms_in_model_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Keep torch norms' weights in the model's dtype. The local spec builds torch.nn.RMSNorm /
    LayerNorm with fp32 weights whatever params_dtype says; with bf16 activations torch then has no
    fused kernel for them (it warns and runs several element-wise kernels). The optimizer keeps its
    fp32 main copy of every bf16 weight, norms included, as for TransformerEngine's norms."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)


def _router_gemm_without_te() -> None:
    """A model built without TransformerEngine routes with a plain torch matmul. megatron-core
    0.16.1's moe_utils defines ``te_general_gemm`` only when its TransformerEngine imports succeed,
    yet the router reads the name (NameError on a CPU and on a GPU without TE), and calls it when it
    is set (a CUDA kernel, even on a CPU where TE imports): None selects the matmul."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def model_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
