"""The learner's fused causal attention (models/causal_attention.py) computes what megatron-core's
local DotProductAttention computes with an explicit causal mask: outputs and gradients."""

import pytest
import torch

from megatron_rl.learner.learner import forward_logits
from megatron_rl.models.causal_attention import causal_mask
from megatron_rl.models.gpt import model_device


def _attention_pair(layer_scaling: bool, layer_number: int = 3):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.causal_attention import FusedCausalAttention

    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               apply_query_key_layer_scaling=layer_scaling, attention_dropout=0.0)
    args = (config, layer_number, AttnMaskType.causal, "self")
    return FusedCausalAttention(*args), DotProductAttention(*args)


@pytest.mark.parametrize("layer_scaling", [False, True])
def test_fused_equals_megatrons_masked_attention(megatron_world, layer_scaling):
    fused, reference = _attention_pair(layer_scaling)
    torch.manual_seed(0)
    s, b = 11, 3
    device = model_device()  # Megatron's attention takes its score buffer from the current device
    q = torch.randn(s, b, 4, 16, device=device, requires_grad=True)
    k = torch.randn(s, b, 2, 16, device=device, requires_grad=True)
    v = torch.randn(s, b, 2, 16, device=device, requires_grad=True)
    out = fused(q, k, v, None)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = reference(q, k, v, causal_mask(s, q.device))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    assert out.shape == expected.shape == (s, b, 64)
    assert (out - expected).abs().max().item() < 1e-5
    for got, want in zip(grads, expected_grads):
        assert (got - want).abs().max().item() < 1e-4


def test_an_explicit_mask_takes_megatrons_path(megatron_world):
    fused, reference = _attention_pair(False)
    torch.manual_seed(1)
    s, b = 7, 2
    q, k, v = (torch.randn(s, b, heads, 16, device=model_device()) for heads in (4, 2, 2))
    padding = torch.zeros(b, 1, 1, s, dtype=torch.bool, device=q.device)
    padding[0, ..., :3] = True  # row 0 left-padded, as the rollout engine's prefill masks it
    mask = causal_mask(s, q.device) | padding
    assert torch.equal(fused(q, k, v, mask), reference(q, k, v, mask))


def test_learner_forward_equals_the_explicitly_masked_forward(megatron_world, tiny_cfg):
    """The learner's mask-less forward (fused kernel) against the same model given the causal mask
    (megatron-core's path), on right-padded rows: logits and parameter gradients."""
    from megatron_rl.models.gpt import build_gpt_model

    torch.manual_seed(2)
    model = build_gpt_model(tiny_cfg.model, vocab_size=16)
    tokens = torch.randint(1, 16, (4, 12)).to(model_device())
    tokens[1, 8:] = 0  # right padding
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)

    def run(mask_given: bool):
        model.zero_grad()
        logits = model(tokens, positions, causal_mask(s, tokens.device)) if mask_given else forward_logits(model, tokens)
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fused_logits, fused_grads = run(False)
    megatron_logits, megatron_grads = run(True)
    assert (fused_logits - megatron_logits).abs().max().item() < 1e-5
    for name, grad in fused_grads.items():
        assert (grad - megatron_grads[name]).abs().max().item() < 1e-4, name
