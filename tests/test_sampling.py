"""Top-k / top-p filtering and the reported logprobs."""

import math

import torch

from megatron_rl.rollout.sampling import filter_logits, sample_tokens


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = filter_logits(logits, top_k=2)
    assert torch.isinf(out[0, [0, 3]]).all() and out[0, 1] == 3.0 and out[0, 2] == 2.0


def test_top_p_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # Mass before each token: 0, .5, .8, .95 -> top_p=0.8 keeps the first two only.
    kept = ~torch.isinf(filter_logits(logits, top_p=0.8))
    assert kept.tolist() == [[True, True, False, False]]
    # top_p=0.81 also keeps the third; the top token always survives.
    assert (~torch.isinf(filter_logits(logits, top_p=0.81))).sum().item() == 3
    assert (~torch.isinf(filter_logits(logits, top_p=0.01))).tolist() == [[True, False, False, False]]


def test_samples_respect_filters_and_logprob_is_tempered_full_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).repeat(500, 1)
    tokens, logprobs = sample_tokens(logits, temperature=0.5, top_k=2, generator=gen)
    assert set(tokens.tolist()) <= {0, 1}
    expected = torch.log_softmax(logits[0] / 0.5, -1)
    assert torch.allclose(logprobs, expected[tokens])


def test_sampling_frequencies_follow_tempered_distribution():
    gen = torch.Generator().manual_seed(1)
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(20000, 1)
    tokens, _ = sample_tokens(logits, temperature=1.0, generator=gen)
    assert abs(tokens.float().mean().item() - 0.75) < 0.02


def test_unfiltered_draw_picks_what_multinomial_picks_with_the_tempered_logprob():
    """No top-k/top-p and no streams: the fused draw (compiled on a GPU) takes the generator's
    exponential noise in multinomial's order, so it picks multinomial's token for the same seed;
    the logprob is log softmax(logits / T) in float64."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(64, 1000) * 3).to(dtype)
        for temperature in (1.0, 0.7):
            tempered = logits.float() / temperature
            expected = torch.multinomial(torch.softmax(tempered, -1), 1,
                                         generator=torch.Generator().manual_seed(3)).squeeze(-1)
            tokens, logprobs = sample_tokens(logits, temperature, generator=torch.Generator().manual_seed(3))
            assert torch.equal(tokens, expected)
            reference = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
            torch.testing.assert_close(logprobs.double(), reference, atol=1e-5, rtol=0)
    # A different seed draws differently (the noise is used at all).
    other, _ = sample_tokens(logits, temperature, generator=torch.Generator().manual_seed(4))
    assert (other != tokens).sum() > 8
