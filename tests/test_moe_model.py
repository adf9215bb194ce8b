"""Mixture-of-experts GPT models built from ModelConfig: layout per layer, and each MoE layer's
output against a reference written from its own weights (router softmax, top-k, experts)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.config.schema import ModelConfig


def _moe_cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=48, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)
    base.update(kw)
    return ModelConfig(**base)


def _reference_moe(mlp, x: torch.Tensor, topk: int, renormalise: bool) -> torch.Tensor:
    """out = sum over the top-k experts of p_e * down(silu(gate x) * up x) (+ shared expert)."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(flat @ mlp.router.weight.t(), dim=-1)
    top_p, top_i = torch.topk(probs, topk, dim=-1)
    if renormalise:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for e, expert in enumerate(mlp.experts.local_experts):
        gate, up = torch.chunk(expert.linear_fc1.weight, 2, dim=0)
        y = (F.silu(flat @ gate.t()) * (flat @ up.t())) @ expert.linear_fc2.weight.t()
        weight = (top_p * (top_i == e)).sum(-1, keepdim=True)
        out = out + weight * y
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        gate, up = torch.chunk(shared.linear_fc1.weight, 2, dim=0)
        y = (F.silu(flat @ gate.t()) * (flat @ up.t())) @ shared.linear_fc2.weight.t()
        if shared.gate_weight is not None:
            y = y * torch.sigmoid(flat @ shared.gate_weight.t())
        out = out + y
    return out.reshape(x.shape)


@pytest.mark.parametrize("renormalise,shared", [(True, False), (False, True)])
def test_moe_layer_matches_reference(megatron_world, renormalise, shared):
    from megatron_rl.models.gpt import build_gpt_model

    cfg = _moe_cfg(moe_norm_topk_prob=renormalise, moe_shared_expert_ffn_hidden_size=40 if shared else 0,
                   moe_shared_expert_gate=shared)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, vocab_size=64).eval()
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(5, 3, cfg.hidden_size)  # [s, b, h]
    with torch.no_grad():
        out, bias = mlp(x)
        ref = _reference_moe(mlp, x, cfg.moe_router_topk, renormalise)
    assert bias is None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_moe_layer_pattern_and_names(megatron_world):
    from megatron_rl.models.gpt import build_gpt_model

    cfg = _moe_cfg(moe_layer_pattern=[0, 1], moe_shared_expert_ffn_hidden_size=40, moe_shared_expert_gate=True)
    model = build_gpt_model(cfg, vocab_size=64)
    names = {k for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    # Layer 0 is dense with the model's ffn size; layer 1 routes over 4 experts of size 24.
    assert model.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 48, 32)
    assert "decoder.layers.0.mlp.router.weight" not in names
    assert model.state_dict()["decoder.layers.1.mlp.router.weight"].shape == (4, 32)
    for e in range(4):
        assert model.state_dict()[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"].shape == (48, 32)
    assert model.state_dict()["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].shape == (80, 32)
    assert model.state_dict()["decoder.layers.1.mlp.shared_experts.gate_weight"].shape == (1, 32)
    tokens = torch.randint(0, 64, (2, 7))
    from megatron_rl.learner.learner import forward_logits

    with torch.no_grad():
        logits = forward_logits(model.eval(), tokens)
    assert logits.shape == (2, 7, 64) and torch.isfinite(logits).all()


def test_dense_config_builds_no_experts(megatron_world):
    from megatron_rl.models.gpt import build_gpt_model, transformer_config

    assert transformer_config(ModelConfig()).num_moe_experts is None
    model = build_gpt_model(ModelConfig(), vocab_size=64)
    assert not any("router" in k or "experts" in k for k in model.state_dict())
