"""Parameter, FLOP and byte arithmetic of a model config, shared by the GPU benchmarks.

Matmul weights only: the embedding lookup is no matmul (the LM head, tied or not, is counted once),
norms and biases are negligible. Per layer:
- attention: Q, K, V and output projections (GQA), or multi-head latent attention's down/up
  projections (DeepSeek-V3);
- a dense layer: SwiGLU's gate, up and down, 3 · H · ffn;
- an MoE layer: the router H · E, every routed expert's 3 · H · I (all experts: ``matmul_params``;
  the ``top_k`` a token is routed to: ``active_matmul_params``), and the shared expert's
  3 · H · S (+ its H · 1 gate) where there is one.
LoRA (``lora_params``): each adapted projection's A (rank × in) and B (out × rank), which a
learner whose base is frozen trains alone.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple


def head_dims(m) -> Tuple[int, int]:
    """(query/key, value) width of one attention head."""
    if m.kv_lora_rank is not None:  # multi-head latent attention
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    return hd, hd


def attention_params(m) -> int:
    """One layer's attention matmul weights."""
    h, heads = m.hidden_size, m.num_attention_heads
    d_qk, d_v = head_dims(m)
    if m.kv_lora_rank is None:
        return h * (heads * d_qk + 2 * m.num_query_groups * d_qk) + heads * d_v * h
    q = h * heads * d_qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * heads * d_qk
    kv_down = h * (m.kv_lora_rank + m.qk_rope_head_dim)
    kv_up = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv_down + kv_up + heads * d_v * h


def moe_layers(m) -> List[bool]:
    """Per layer: True where the MLP is a mixture of experts."""
    if not m.num_experts:
        return [False] * m.num_layers
    return [bool(x) for x in (m.moe_layer_pattern or [1] * m.num_layers)]


def expert_params(m) -> int:
    """One routed expert's SwiGLU weights."""
    return 3 * m.hidden_size * (m.moe_ffn_hidden_size or m.ffn_hidden_size)


def always_on_moe_params(m) -> int:
    """What every token of an MoE layer multiplies besides its routed experts: router, shared
    expert and its gate."""
    shared = 3 * m.hidden_size * m.moe_shared_expert_ffn_hidden_size
    gate = m.hidden_size if m.moe_shared_expert_gate else 0
    return m.hidden_size * m.num_experts + shared + gate


def _params(m, vocab: int, experts_per_token: int) -> int:
    dense_mlp = 3 * m.hidden_size * m.ffn_hidden_size
    total = vocab * m.hidden_size
    for moe in moe_layers(m):
        mlp = always_on_moe_params(m) + experts_per_token * expert_params(m) if moe else dense_mlp
        total += attention_params(m) + mlp
    return total


def matmul_params(m, vocab: int) -> int:
    """Every matmul weight of the model (all experts of an MoE layer) and the LM head."""
    return _params(m, vocab, m.num_experts)


def active_matmul_params(m, vocab: int) -> int:
    """The matmul weights one token multiplies: as ``matmul_params`` with only the ``top_k``
    experts it is routed to. Equal to ``matmul_params`` for a dense model."""
    return _params(m, vocab, m.moe_router_topk if m.num_experts else 0)


def lora_shapes(m) -> Dict[str, Tuple[int, int]]:
    """(in, out) of each projection LoRA can adapt (models/lora.py's targets), one layer, fused
    as megatron-core fuses them: q/k/v in linear_qkv, gate and up in linear_fc1."""
    h, heads = m.hidden_size, m.num_attention_heads
    d_qk, d_v = head_dims(m)
    return {"linear_qkv": (h, heads * d_qk + m.num_query_groups * (d_qk + d_v)), "linear_proj": (heads * d_v, h),
            "linear_fc1": (h, 2 * m.ffn_hidden_size), "linear_fc2": (m.ffn_hidden_size, h)}


def lora_params(m, rank: int, targets: Sequence[str]) -> int:
    """Parameters of rank-``rank`` adapters on ``targets`` in every layer: rank · (in + out) per
    adapted projection. An MoE layer's MLP is its routed experts, which carry none (models/lora.py
    adapts attention only there); multi-head latent attention has no linear_qkv to adapt."""
    if m.kv_lora_rank is not None and "linear_qkv" in targets:
        raise ValueError("multi-head latent attention has no linear_qkv: adapt linear_proj only")
    shapes = lora_shapes(m)
    total = 0
    for moe in moe_layers(m):
        for target in targets:
            if moe and target in ("linear_fc1", "linear_fc2"):
                continue
            total += rank * sum(shapes[target])
    return total


def attention_flops(m, seq: int) -> int:
    """Forward FLOPs of one row's causal attention over ``seq`` tokens: QKᵀ (2 · s² · d_qk) and
    PV (2 · s² · d_v) per head and layer, half of it masked."""
    d_qk, d_v = head_dims(m)
    return m.num_layers * m.num_attention_heads * (d_qk + d_v) * seq * seq


def kv_bytes_per_token(m, dtype_bytes: int = 2) -> int:
    """Bytes of cached keys and values per token over all layers (MLA caches full per-head keys
    and values, as Megatron's multi-latent attention stores them)."""
    d_qk, d_v = head_dims(m)
    if m.kv_lora_rank is not None:
        return m.num_layers * m.num_attention_heads * (d_qk + d_v) * dtype_bytes
    return m.num_layers * 2 * m.num_query_groups * d_qk * dtype_bytes


def experts_touched(m, tokens: int) -> float:
    """Expected distinct routed experts per MoE layer that ``tokens`` tokens reach under uniform
    routing: each token picks top_k of E, so an expert is missed by all of them with probability
    (1 - k/E)^tokens."""
    if not m.num_experts:
        return 0.0
    e, k = m.num_experts, m.moe_router_topk
    return e * (1.0 - (1.0 - k / e) ** tokens)


def decode_weight_params(m, vocab: int, rows: int) -> float:
    """Matmul weights one decode step of ``rows`` tokens reads: everything but the routed
    experts, plus the experts those tokens are expected to reach (all of them once rows · top_k
    is well above the expert count)."""
    untouched = m.num_experts - experts_touched(m, rows)
    return matmul_params(m, vocab) - sum(moe_layers(m)) * untouched * expert_params(m)
