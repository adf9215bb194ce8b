"""Chunked logprobs / entropy (learner/logprobs.py) against an unchunked float64 reference: values,
gradients through both outputs, temperature, bf16 logits, and that no fp32 tensor of the whole
[tokens × vocabulary] is ever allocated. Vocabulary-parallel shards (TP=2, several chunks per
shard): tests/test_learner_parallel.py, whose ranks run the learner with small chunks."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.learner.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def loss_of(lp: torch.Tensor, ent: torch.Tensor, w_lp: torch.Tensor, w_ent: torch.Tensor) -> torch.Tensor:
    return (lp * w_lp).sum() + (ent * w_ent).sum()


def test_chunked_equals_float64_reference_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    b, s, v = 3, 7, 50
    for temperature in (1.0, 0.7):
        logits = (torch.randn(b, s, v, generator=gen) * 3).requires_grad_(True)
        targets = torch.randint(0, v, (b, s), generator=gen)
        w_lp, w_ent = torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen)
        # chunk of 2 rows * 50: many chunks, the last one partial
        lp, ent = token_logprobs_and_entropy(logits, targets, temperature, chunk_elements=2 * v)
        loss_of(lp, ent, w_lp, w_ent).backward()
        grad = logits.grad.clone()

        ref_logits = logits.detach().double().requires_grad_(True)
        ref_lp, ref_ent = reference(ref_logits, targets, temperature)
        loss_of(ref_lp, ref_ent, w_lp.double(), w_ent.double()).backward()
        assert lp.dtype == torch.float32 and lp.shape == (b, s)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-5)
        torch.testing.assert_close(grad.double(), ref_logits.grad, rtol=0, atol=2e-6)


def test_gradient_through_one_output_only_and_wrappers():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 33, generator=gen, requires_grad=True)
    targets = torch.randint(0, 33, (9,), generator=gen)
    token_logprobs(logits, targets, 1.3, chunk_elements=40).sum().backward()
    ref_logits = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = reference(ref_logits, targets, 1.3)
    ref_lp.sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=0, atol=2e-6)

    logits.grad = None
    ref_logits.grad = None
    token_entropy(logits, 1.3, chunk_elements=40).sum().backward()
    reference(ref_logits, targets, 1.3)[1].sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=0, atol=2e-6)


def test_bf16_logits_keep_their_dtype_and_match_reference():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 64, generator=gen) * 4).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 64, (4,), generator=gen)
    lp, ent = token_logprobs_and_entropy(logits, targets, 1.0, chunk_elements=64)
    (lp.sum() + ent.sum()).backward()
    ref_lp, ref_ent = reference(logits.detach(), targets, 1.0)
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)


class LargestFloat32(TorchDispatchMode):
    """Records the largest fp32 tensor any operator produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_float32_tensor_of_the_whole_token_budget():
    tokens, vocab, chunk = 64, 512, 8 * 512
    logits = torch.randn(tokens, vocab).bfloat16().requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    with LargestFloat32() as mode:
        lp, ent = token_logprobs_and_entropy(logits, targets, 0.9, chunk_elements=chunk)
        (lp.sum() - 0.1 * ent.sum()).backward()
    assert 0 < mode.largest <= chunk, mode.largest
    # The check sees such tensors: the unchunked reference allocates the whole [tokens, vocab] in fp32.
    with LargestFloat32() as mode:
        reference(logits.detach().float(), targets, 0.9)
    assert mode.largest >= tokens * vocab


def test_model_logits_are_the_lm_heads_own_tensor(megatron_world):
    """GPTModel returns [b, s, V] logits by transposing the head's [s, b, V] output and copying it
    (10 GB per 16k tokens at a 152k vocabulary). Our head writes batch-major, so what the model
    returns is the head's own tensor, not a copy, and values and gradients are unchanged."""
    from megatron_rl.config.schema import RootConfig
    from megatron_rl.models.gpt import build_gpt_model

    cfg = RootConfig()
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 64, 128
    model = build_gpt_model(cfg.model, 48)
    heads = []
    model.output_layer.register_forward_hook(lambda module, args, output: heads.append(output[0]))
    tokens = torch.randint(0, 48, (3, 7), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(7).expand(3, 7)
    logits = model(tokens, positions, None)
    assert logits.shape == (3, 7, 48) and logits.is_contiguous()
    assert logits.data_ptr() == heads[-1].data_ptr()  # no copy after the head
    logits.pow(2).sum().backward()
    grad = model.output_layer.weight.grad.clone()

    model.output_layer._forward_pre_hooks.clear()  # megatron-core's own [s, b, V] head
    model.output_layer._forward_hooks.clear()
    model.zero_grad(set_to_none=True)
    reference = model(tokens, positions, None)
    reference.pow(2).sum().backward()
    torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, model.output_layer.weight.grad, rtol=1e-5, atol=1e-5)
