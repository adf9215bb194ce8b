"""GAE, advantage whitening and the clipped value loss against float64 references written from
the published formulas (plain Python loops, no code shared with the implementation)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import clipped_value_loss, explained_variance, gae_advantages, masked_whiten


def gae_reference(rewards, values, gamma, lam):
    # Schulman et al. 2016, eq. (16): A_t = Σ_{l=0}^{T-t-1} (γλ)^l δ_{t+l},
    # δ_t = r_t + γ V(s_{t+1}) - V(s_t), V(s_T) = 0 at the end of the episode.
    T = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < T else 0.0) - values[t] for t in range(T)]
    adv = [sum((gamma * lam) ** l * deltas[t + l] for l in range(T - t)) for t in range(T)]
    return adv, [a + v for a, v in zip(adv, values)]


def pad(rows, width):
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float64)


rows_st = st.lists(st.integers(0, 9), min_size=1, max_size=5)  # response lengths, 0 = empty response


@settings(max_examples=300, deadline=None)
@given(rows_st, st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.data())
def test_gae_matches_reference(lengths, gamma, lam, data):
    width = max(lengths) + data.draw(st.integers(0, 2))  # extra padding columns on some batches
    floats = st.floats(-5, 5, allow_nan=False)
    rewards = [[data.draw(floats) for _ in range(n)] for n in lengths]
    values = [[data.draw(floats) for _ in range(n)] for n in lengths]
    valid = pad([[1.0] * n for n in lengths], width)
    # Garbage in the padding must not leak into the rows.
    garbage = torch.full((len(lengths), width), 7.0, dtype=torch.float64) * (1 - valid)
    adv, ret = gae_advantages(pad(rewards, width) + garbage, pad(values, width) - garbage, valid, gamma, lam)
    for i, n in enumerate(lengths):
        ref_adv, ref_ret = gae_reference(rewards[i], values[i], gamma, lam)
        assert adv[i, :n].tolist() == pytest.approx(ref_adv, abs=1e-9)
        assert ret[i, :n].tolist() == pytest.approx(ref_ret, abs=1e-9)
        assert adv[i, n:].abs().sum() == 0 and ret[i, n:].abs().sum() == 0


def test_gae_hand_computed():
    # Outcome reward 1 at the last of 3 tokens, V = (0.5, 0.25, 0.75), γ = 1, λ = 0.5:
    # δ = (0 + 0.25 - 0.5, 0 + 0.75 - 0.25, 1 + 0 - 0.75) = (-0.25, 0.5, 0.25)
    # A_2 = 0.25; A_1 = 0.5 + 0.5·0.25 = 0.625; A_0 = -0.25 + 0.5·0.625 = 0.0625.
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.25, 0.75]], dtype=torch.float64)
    adv, ret = gae_advantages(r, v, torch.ones_like(r), gamma=1.0, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.0625, 0.625, 0.25])
    assert ret[0].tolist() == pytest.approx([0.5625, 0.875, 1.0])
    # λ = 1, γ = 1: every token's advantage is the return minus its own value (Monte Carlo).
    adv, ret = gae_advantages(r, v, torch.ones_like(r), gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.5, 0.75, 0.25])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must all be"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-4, 4), st.booleans()), min_size=1, max_size=20))
def test_masked_whiten_matches_reference(entries):
    xs = [x for x, keep in entries if keep]
    out = masked_whiten(torch.tensor([[x for x, _ in entries]], dtype=torch.float64),
                        torch.tensor([[float(k) for _, k in entries]], dtype=torch.float64))[0].tolist()
    if not xs:
        assert out == [0.0] * len(entries)
        return
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    ref = [(x - mean) / (std + 1e-8) if k else 0.0 for x, k in entries]
    assert out == pytest.approx(ref, abs=1e-6)


def test_clipped_value_loss_hand_computed():
    # Token 0: V moved 0.5 past V_old (clip 0.2): clipped V = 0.2, R = 1 -> max((0.5-1)², (0.2-1)²) = 0.64.
    # Token 1: inside the clip: ½(0.1 - 0)² = 0.005. Token 2 is masked out.
    v = torch.tensor([[0.5, 0.1, 3.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = clipped_value_loss(v, old, ret, mask, clip=0.2)
    assert loss[0].tolist() == pytest.approx([0.32, 0.005, 0.0])
    assert stats["value_clipped_tokens"] == 1
    assert stats["value_error_sq_sum"] == pytest.approx(0.25 + 0.01)
    loss, _ = clipped_value_loss(v, old, ret, mask, clip=0.0)
    assert loss[0].tolist() == pytest.approx([0.125, 0.005, 0.0])


def test_clipped_value_loss_gradient():
    def grad(v, old, ret):
        v = torch.tensor([[v]], dtype=torch.float64, requires_grad=True)
        loss, _ = clipped_value_loss(v, torch.tensor([[old]], dtype=torch.float64),
                                     torch.tensor([[ret]], dtype=torch.float64), torch.ones(1, 1), clip=0.2)
        loss.sum().backward()
        return v.grad.item()

    # The clipped term is the larger: V moved past the clip, toward R; no further push.
    assert grad(0.5, 0.0, 1.0) == 0.0
    # The unclipped term is the larger: V moved away from R; pulled back with gradient V - R.
    assert grad(0.5, 0.0, -1.0) == pytest.approx(1.5)
    # Inside the clip both terms are equal; gradient V - R.
    assert grad(0.1, 0.0, 1.0) == pytest.approx(-0.9)


def test_explained_variance():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = torch.ones_like(r)
    assert explained_variance(r, r, m) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2.5), r, m) == pytest.approx(0.0)
    assert explained_variance(r, r, torch.tensor([[1.0, 0, 0, 0]])) == 0.0
