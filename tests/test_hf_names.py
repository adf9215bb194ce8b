"""Megatron <-> Hugging Face name and layout mapping (fused QKV with GQA, gated MLP)."""

import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.hf_names import fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv


def test_qkv_split_matches_head_grouping():
    cfg = ModelConfig(hidden_size=8, num_attention_heads=4, num_query_groups=2)  # head_dim 2, 2 q per group
    # Label each fused row by (group, slot): rows [q0 q0 q1 q1 k k v v] per group.
    fused = torch.arange(2 * 8, dtype=torch.float).unsqueeze(1).repeat(1, 8)
    q, k, v = split_qkv(fused, cfg)
    assert q[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert k[:, 0].tolist() == [4, 5, 12, 13]
    assert v[:, 0].tolist() == [6, 7, 14, 15]
    assert torch.equal(fuse_qkv(q, k, v, cfg), fused)


def test_roundtrip_is_bitwise(megatron_world):
    from megatron_rl.models.gpt import build_gpt_model

    cfg = ModelConfig(family="qwen2", num_layers=2, hidden_size=32, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=48)
    model = build_gpt_model(cfg, vocab_size=40)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    hf = dict(kv for name, t in state.items() for kv in megatron_to_hf(name, t, cfg))
    assert "model.layers.1.self_attn.q_proj.bias" in hf  # qwen2 has q/k/v biases
    assert hf["model.layers.0.mlp.gate_proj.weight"].shape == (48, 32)
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    back = hf_to_megatron(hf, state.keys(), cfg)
    for name, tensor in state.items():
        if not name.endswith("_extra_state"):
            assert torch.equal(back[name], tensor), name
