"""Algorithms against hand-computed values and float64 references."""

import math

import pytest
import torch

from megatron_rl.algorithms import group_relative_advantages, kl_penalty, ppo_clip_loss


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    adv = group_relative_advantages(rewards, normalize_by_std=True, eps=0.0 + 1e-12)
    # Group 1: mean 0.5, unbiased std sqrt(1/3).
    s = math.sqrt(1 / 3)
    expected = torch.tensor([[0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], [0.0] * 4], dtype=torch.float64)
    assert torch.allclose(adv, expected, atol=1e-9)


def test_grpo_without_std_only_centres():
    rewards = torch.tensor([[3.0, 1.0, 2.0]], dtype=torch.float64)
    assert group_relative_advantages(rewards, normalize_by_std=False).tolist() == [[1.0, -1.0, 0.0]]


def test_grpo_rejects_flat_input():
    with pytest.raises(ValueError, match="groups, group_size"):
        group_relative_advantages(torch.ones(4))


def test_ppo_clip_hand_computed():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64))
    new = torch.log(torch.tensor([0.75, 0.75, 0.25, 0.5], dtype=torch.float64))  # ratios 1.5, 1.5, 0.5, 1
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    loss, stats = ppo_clip_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.3)
    # A>0, r=1.5: min(1.5, 1.3) = 1.3 -> -1.3 (clipped). A<0, r=1.5: min(-1.5, -1.3) = -1.5 -> 1.5.
    # A<0, r=0.5: min(-0.5, -0.8) = -0.8 -> 0.8 (clipped). Masked token contributes 0.
    assert torch.allclose(loss, torch.tensor([-1.3, 1.5, 0.8, 0.0], dtype=torch.float64))
    assert stats["clipped_tokens"].item() == 2.0
    assert math.isclose(stats["ratio_sum"].item(), 3.5)


def test_ppo_clip_gradient_is_zero_when_clipped():
    old = torch.zeros(2, dtype=torch.float64)
    new = torch.tensor([0.5, 0.05], dtype=torch.float64, requires_grad=True)  # ratio e^0.5 clipped, e^0.05 not
    loss, _ = ppo_clip_loss(new, old, torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    loss.sum().backward()
    assert new.grad[0].item() == 0.0
    assert math.isclose(new.grad[1].item(), -math.exp(0.05))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator):
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    lr = ref - logp  # [-0.5, 1.0]
    expected = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1 - lr}[estimator]
    assert torch.allclose(kl_penalty(logp, ref, estimator), expected)


def test_kl_estimators_agree_in_expectation():
    # Samples from p; E_p[k1] = E_p[k3] = KL(p || ref) exactly in the limit.
    torch.manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    x = torch.multinomial(p, 200_000, replacement=True)
    true_kl = float((p * (p / ref).log()).sum())
    for est in ("k1", "k3"):
        value = kl_penalty(p.log()[x], ref.log()[x], est).mean().item()
        assert abs(value - true_kl) < 0.01, (est, value, true_kl)


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")


def test_decoupled_ppo_hand_computed():
    from megatron_rl.algorithms.policy_loss import decoupled_ppo_loss

    f = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    behav = f([0.25, 0.5, 0.1]).log()
    prox = f([0.5, 0.5, 0.5]).log()   # w = 2, 1, 5
    new = f([0.6, 0.25, 0.5]).log()   # r = 1.2, 0.5, 1
    adv = f([1.0, -1.0, 1.0])
    mask = f([1.0, 1.0, 1.0])
    loss, stats = decoupled_ppo_loss(new, prox, behav, adv, mask, clip_low=0.2, clip_high=0.3,
                                     behaviour_weight_cap=4.0)
    # tok0: w=2, r=1.2 inside the clip range: -2·1.2. tok1: w=1, A<0, r=0.5 clipped to 0.8: 0.8.
    # tok2: w=5 > cap 4: left out.
    assert torch.allclose(loss, f([-2.4, 0.8, 0.0]))
    assert stats["capped_tokens"].item() == 1.0


def test_decoupled_equals_ppo_when_behaviour_is_proximal():
    from megatron_rl.algorithms.policy_loss import decoupled_ppo_loss

    torch.manual_seed(0)
    old = torch.randn(6, dtype=torch.float64) - 2
    new = old + 0.3 * torch.randn(6, dtype=torch.float64)
    adv, mask = torch.randn(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    a, _ = decoupled_ppo_loss(new, old, old, adv, mask, 0.2, 0.28, behaviour_weight_cap=5.0)
    b, _ = ppo_clip_loss(new, old, adv, mask, 0.2, 0.28)
    assert torch.equal(a, b)


def _agg_reference(losses, masks, mode, norm_length):
    """Float64 loops, straight from the definitions (no shared code)."""
    rows = [(l, m) for l, m in zip(losses, masks) if sum(m) > 0]
    n = len(rows)
    if mode == "token-mean":
        return sum(x * y for l, m in rows for x, y in zip(l, m)) / sum(sum(m) for _, m in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(x * y for x, y in zip(l, m)) / sum(m) for l, m in rows) / n
    total = sum(x * y for l, m in rows for x, y in zip(l, m))
    return total / n if mode == "seq-mean-token-sum" else total / (n * norm_length)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_loss_aggregation_matches_reference_and_adds_up_over_micro_batches(mode):
    from megatron_rl.algorithms.policy_loss import aggregate_loss

    gen = torch.Generator().manual_seed(0)
    losses = torch.randn(7, 9, generator=gen, dtype=torch.float64)
    lengths = [9, 1, 4, 0, 6, 2, 9]  # row 3 is filler
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(9)] for n in lengths], dtype=torch.float64)
    ref = _agg_reference(losses.tolist(), mask.tolist(), mode, norm_length=12)
    num, den = aggregate_loss(losses, mask, mode, norm_length=12)
    assert (num / den).item() == pytest.approx(ref, rel=1e-12)
    # Split into micro-batches of 3, 1 and 3 rows: numerators and denominators add up.
    parts = [aggregate_loss(losses[a:b], mask[a:b], mode, norm_length=12) for a, b in ((0, 3), (3, 4), (4, 7))]
    assert (sum(p[0] for p in parts) / sum(p[1] for p in parts)).item() == pytest.approx(ref, rel=1e-12)


def test_loss_aggregation_rejects_unknown_mode():
    from megatron_rl.algorithms.policy_loss import aggregate_loss

    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(torch.ones(1, 2), torch.ones(1, 2), "sum")


def test_dual_clip_by_hand():
    from megatron_rl.algorithms.policy_loss import ppo_clip_loss

    # A = -1, r = e^2 ≈ 7.39: PPO's min(r·A, clip(r)·A) = -7.39; dual clip c = 3 bounds it at -3.
    lp, old = torch.tensor([[2.0, 0.0, 2.0]]), torch.zeros(1, 3)
    adv, mask = torch.tensor([[-1.0, -1.0, 1.0]]), torch.ones(1, 3)
    plain, _ = ppo_clip_loss(lp, old, adv, mask, 0.2, 0.2)
    dual, _ = ppo_clip_loss(lp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
    assert plain[0, 0].item() == pytest.approx(math.exp(2.0))
    assert dual[0, 0].item() == pytest.approx(3.0)
    # r = 1 (unclipped) and positive advantages are untouched.
    assert dual[0, 1].item() == plain[0, 1].item() == pytest.approx(1.0)
    assert dual[0, 2].item() == plain[0, 2].item() == pytest.approx(-1.2)


def _gspo_reference(lp, old, adv, lengths, clip_low, clip_high):
    """GSPO objective from the paper, float64: mean over sequences of -min(s·A, clip(s)·A),
    s = exp(mean over the sequence's tokens of the log-ratio)."""
    total = 0.0
    for i, n in enumerate(lengths):
        s = torch.exp((lp[i, :n] - old[i, :n]).mean())
        a = adv[i, 0]
        total = total - torch.minimum(s * a, torch.clamp(s, 1 - clip_low, 1 + clip_high) * a)
    return total / len(lengths)


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.5, 0.5)])
def test_gspo_value_and_gradient_match_the_sequence_level_objective(clip):
    from megatron_rl.algorithms.policy_loss import aggregate_loss, gspo_loss

    gen = torch.Generator().manual_seed(3)
    lengths = [5, 1, 3, 4]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(5)] for n in lengths], dtype=torch.float64)
    old = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 2
    lp = (old + 0.05 * torch.randn(4, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0], [-0.5], [2.0], [-1.5]], dtype=torch.float64).expand(4, 5)

    loss, _ = gspo_loss(lp, old, adv, mask, *clip)
    num, den = aggregate_loss(loss, mask, "seq-mean-token-mean")
    ours = num / den
    (grad_ours,) = torch.autograd.grad(ours, lp)

    lp_ref = lp.detach().clone().requires_grad_(True)
    ref = _gspo_reference(lp_ref, old, adv, lengths, *clip)
    (grad_ref,) = torch.autograd.grad(ref, lp_ref)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-14)
    assert torch.allclose(grad_ours * mask, grad_ref * mask, atol=1e-12)


def test_kl_shaped_reward_by_hand():
    from megatron_rl.algorithms.kl import kl_shaped_reward

    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    # k1 = logp - logp_ref per token: 0.5 and -1.0, summed -0.5; reward 1 - 0.1·(-0.5) = 1.05.
    assert kl_shaped_reward(1.0, lp, ref, 0.1, "k1") == pytest.approx(1.05)
    # k3 = e^(ref-lp) - 1 - (ref-lp): e^-0.5 - 0.5 and e^1 - 2.
    k3 = (math.exp(-0.5) - 1 + 0.5) + (math.exp(1.0) - 1 - 1.0)
    assert kl_shaped_reward(1.0, lp, ref, 0.1, "k3") == pytest.approx(1.0 - 0.1 * k3)


def test_decoupled_sequence_level_weight_against_reference():
    """weight_level=sequence: every token of a response carries min(Π_t π_prox/π_behav, cap),
    the product over the response's own (masked) tokens."""
    import math

    from megatron_rl.algorithms.policy_loss import decoupled_ppo_loss

    gen = torch.Generator().manual_seed(3)
    new = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    prox = new + 0.05 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    behav = prox + 0.4 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv = torch.tensor([[1.0] * 4, [-0.5] * 4, [2.0] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    cap = 1.5
    loss, stats = decoupled_ppo_loss(new, prox, behav, adv, mask, 0.2, 0.2, behaviour_weight_cap=cap,
                                     weight_level="sequence")
    for i in range(3):
        log_w = sum(float(prox[i, t] - behav[i, t]) for t in range(4) if mask[i, t])
        w = min(math.exp(log_w), cap)
        for t in range(4):
            r = math.exp(float(new[i, t] - prox[i, t]))
            a = float(adv[i, t])
            ref = -w * min(r * a, min(max(r, 0.8), 1.2) * a) if mask[i, t] else 0.0
            assert float(loss[i, t]) == pytest.approx(ref, abs=1e-12)
    with pytest.raises(ValueError, match="token or sequence"):
        decoupled_ppo_loss(new, prox, behav, adv, mask, weight_level="group")
