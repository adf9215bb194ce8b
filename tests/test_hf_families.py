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
