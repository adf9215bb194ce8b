"""For every model family: a tiny random transformers model, converted to Megatron, gives the same
logits (fp32, <= 1e-4) on the same tokens; converted back, every tensor is bitwise the original."""

import pytest
import torch

from hf_helpers import FAMILY_CONFIGS, hf_logits, save_random_hf_model

pytest.importorskip("transformers")


def _megatron_from_hf(path):
    from megatron_rl.models.gpt import build_gpt_model
    from megatron_rl.models.hf_checkpoint import HFTensorReader, load_hf_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    cfg, vocab = model_config_from_hf(read_hf_config(path))
    model = build_gpt_model(cfg, vocab_size=vocab).eval()
    unused = load_hf_weights(model, HFTensorReader(path), cfg)
    assert unused == []
    return model, cfg


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_logits_match_and_roundtrip_is_bitwise(megatron_world, tmp_path, family):
    from safetensors.torch import load_file

    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.hf_checkpoint import HFTensorReader, full_state, hf_tensors, write_hf_checkpoint
    from megatron_rl.models.hf_config import hf_config_from_model, read_hf_config

    src = tmp_path / "hf"
    hf_model = save_random_hf_model(family, src)
    model, cfg = _megatron_from_hf(src)
    assert cfg.family == family

    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = forward_logits(model, tokens)
    theirs = hf_logits(hf_model, tokens)
    assert ours.shape == theirs.shape
    gap = (ours - theirs).abs().max().item()
    assert gap <= 1e-4, f"{family}: max |logit gap| {gap}"

    out = tmp_path / "back"
    write_hf_checkpoint(out, hf_tensors(full_state(model).items(), cfg), hf_config_from_model(cfg, 96))
    original = load_file(str(src / "model.safetensors"))
    back = HFTensorReader(out)
    assert sorted(back.names()) == sorted(original)
    for name, tensor in original.items():
        got = back.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
    # The config written back describes the same model.
    from megatron_rl.models.hf_config import model_config_from_hf

    assert model_config_from_hf(read_hf_config(out)) == model_config_from_hf(read_hf_config(src))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("original, low, high", [(8192, 1.0, 4.0), (4096, 1.0, 4.0), (131072, 2.0, 16.0)])
def test_llama3_frequency_table_is_transformers_one(dtype, original, low, high):
    """Every regime (kept, interpolated, slowed) of a 128-wide head, for any original context."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    from megatron_rl.models.rope import llama3_inv_freq

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original, "rope_theta": 500000.0}
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_scaling=rope, rope_theta=500000.0)
    theirs, _ = _compute_llama3_parameters(config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=dtype) / 128))
    ours = llama3_inv_freq(plain, 8.0, low, high, original)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-6, atol=0)
    wavelen = 2 * torch.pi / plain
    assert (wavelen < original / high).any() and (wavelen > original / low).any()
    assert ((wavelen > original / high) & (wavelen < original / low)).any()


def test_llama3_rope_with_another_original_context_matches_transformers(megatron_world, tmp_path):
    """original_max_position_embeddings=16384: the 8-wide heads' third frequency is interpolated."""
    from megatron_rl.learner.learner import forward_logits

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16384}
    hf_model = save_random_hf_model("llama", tmp_path / "hf", rope_scaling=rope)
    model, cfg = _megatron_from_hf(tmp_path / "hf")
    assert cfg.rope_original_max_position_embeddings == 16384
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.cpu(), hf_model.model.rotary_emb.inv_freq,
                               rtol=1e-6, atol=0)
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = forward_logits(model, tokens)
    gap = (ours - hf_logits(hf_model, tokens)).abs().max().item()
    assert gap <= 1e-4, f"max |logit gap| {gap}"
