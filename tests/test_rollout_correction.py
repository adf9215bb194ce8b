"""Rollout correction and CISPO against float64 references written from the formulas, token by
token in plain Python; then through the learner: off changes nothing, on drops what it says."""

import copy
import math

import pytest
import torch

from megatron_rl.algorithms.policy_loss import cispo_loss, ppo_clip_loss
from megatron_rl.algorithms.rollout_correction import Correction, rollout_correction
from megatron_rl.config.schema import RootConfig
from megatron_rl.checks import validate
from megatron_rl.config import ConfigError
from megatron_rl.types import Trajectory

from batches import advantaged

F64 = torch.float64
# Two responses of four places; the second has three tokens (its last place is padding).
PROX = [[-1.0, -0.5, -0.2, -0.1], [-0.3, -4.0, -1.0, 0.0]]
BEHAV = [[-1.2, -0.5, -0.6, -0.1], [-0.3, -0.2, -1.1, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


def _tensors():
    return (torch.tensor(PROX, dtype=F64), torch.tensor(BEHAV, dtype=F64), torch.tensor(MASK, dtype=F64))


def _ratios():
    """ρ_t per place (0 outside the mask), each row's Π ρ_t and geometric mean, in Python floats."""
    rho = [[math.exp(p - b) if m else 0.0 for p, b, m in zip(pr, br, mr)] for pr, br, mr in zip(PROX, BEHAV, MASK)]
    logs = [sum(p - b for p, b, m in zip(pr, br, mr) if m) for pr, br, mr in zip(PROX, BEHAV, MASK)]
    counts = [sum(mr) for mr in MASK]
    return rho, [math.exp(s) for s in logs], [math.exp(s / n) for s, n in zip(logs, counts)]


def _check(weight, keep, expected_weight, expected_keep):
    assert torch.allclose(weight, torch.tensor(expected_weight, dtype=F64), rtol=1e-12, atol=0)
    assert keep.tolist() == expected_keep


def test_token_truncated_importance_weight():
    rho, _, _ = _ratios()
    weight, keep, stats = rollout_correction(*_tensors(), Correction(is_level="token", is_cap=1.5))
    expected = [[min(r, 1.5) if m else 0.0 for r, m in zip(rr, mr)] for rr, mr in zip(rho, MASK)]
    _check(weight, keep, expected, [[float(m) for m in mr] for mr in MASK])
    assert math.isclose(stats["is_weight_sum"].item(), sum(map(sum, expected)), rel_tol=1e-12)
    assert stats["kept_tokens"].item() == 7


def test_sequence_truncated_importance_weight():
    _, seq, _ = _ratios()
    assert seq[1] < 1.5 < seq[0]  # one row under the cap, one over it
    weight, _, _ = rollout_correction(*_tensors(), Correction(is_level="sequence", is_cap=1.5))
    expected = [[min(s, 1.5) * m for m in mr] for s, mr in zip(seq, MASK)]
    _check(weight, weight.ne(0).to(F64), expected, [[float(m) for m in mr] for mr in MASK])


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("band", [(0.5, 2.0), (None, 1.3), (0.9, 1.1)])
def test_rejection_keeps_exactly_the_band(level, band):
    low, high = band
    rho, seq, geo = _ratios()
    kept_low = low if low is not None else 1 / high
    inside = (lambda r: kept_low <= r <= high)
    expected = []
    for i, mr in enumerate(MASK):
        if level == "token":
            expected.append([float(m and inside(rho[i][t])) for t, m in enumerate(mr)])
        else:
            row_ok = inside(seq[i] if level == "sequence" else geo[i])
            expected.append([float(m and row_ok) for m in mr])
    weight, keep, stats = rollout_correction(*_tensors(), Correction(reject=level, reject_low=low, reject_high=high))
    _check(weight, keep, [[float(m) for m in mr] for mr in MASK], expected)  # rejection never weights
    assert stats["rejected_tokens"].item() == 7 - sum(map(sum, expected))


def test_icepop_is_token_weight_inside_a_two_sided_band():
    """IcePop: tokens with ρ in [0.5, 5] keep the weight ρ, the others leave the loss."""
    rho, _, _ = _ratios()
    weight, keep, _ = rollout_correction(*_tensors(), Correction(is_level="token", is_cap=5.0, reject="token",
                                                                   reject_low=0.5, reject_high=5.0))
    for i, mr in enumerate(MASK):
        for t, m in enumerate(mr):
            inside = bool(m) and 0.5 <= rho[i][t] <= 5.0
            assert keep[i, t].item() == float(inside)
            if inside:
                assert math.isclose(weight[i, t].item(), rho[i][t], rel_tol=1e-12)
    assert keep.sum().item() == 6  # ρ = e^-3.8 falls below 0.5


def test_veto_drops_a_whole_response_for_one_unlikely_token():
    # Row 1's second token has ρ = e^-3.8 ≈ 0.022; row 0's smallest is 1.
    _, keep, stats = rollout_correction(*_tensors(), Correction(veto_below=0.05))
    assert keep.tolist() == [[1.0] * 4, [0.0] * 4]
    assert stats["vetoed_tokens"].item() == 3


def test_version_gap_drops_old_tokens_only():
    lag = torch.tensor([[0, 1, 2, 3], [3, 0, 2, 9]], dtype=F64)  # the 9 is padding: never counted
    _, keep, stats = rollout_correction(*_tensors(), Correction(max_version_gap=2), version_lag=lag)
    assert keep.tolist() == [[1, 1, 1, 0], [0, 1, 1, 0]]
    assert stats["version_dropped_tokens"].item() == 2
    with pytest.raises(ValueError, match="version lag"):
        rollout_correction(*_tensors(), Correction(max_version_gap=2))


def test_huge_sequence_ratios_stay_finite():
    prox = torch.zeros(1, 3000, dtype=F64)
    behav = torch.full((1, 3000), -0.1, dtype=F64)  # Π ρ = e^300
    weight, keep, _ = rollout_correction(prox, behav, torch.ones(1, 3000, dtype=F64),
                                         Correction(is_level="sequence", is_cap=1e30, reject="sequence",
                                                    reject_high=1e30))
    assert torch.isfinite(weight).all() and weight[0, 0].item() == pytest.approx(math.exp(20))
    assert keep.sum().item() == 3000


def test_cispo_value_and_gradient_against_the_formula():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=F64))
    probs = [0.9, 0.3, 0.05, 0.5]  # ratios 1.8, 0.6, 0.1, 1.0
    new = torch.log(torch.tensor(probs, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=F64)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64)
    loss, stats = cispo_loss(new, old, adv, mask, clip_low=0.5, clip_high=0.25)
    clipped = [min(max(p / 0.5, 0.5), 1.25) for p in probs]  # 1.25, 0.6, 0.5, 1.0
    expected = [-c * a * m for c, a, m in zip(clipped, adv.tolist(), mask.tolist())]
    assert torch.allclose(loss, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    loss.sum().backward()
    # d/dlogp of -sg(r̂)·A·log π: -r̂·A for every masked token, clipped or not (no token is dropped).
    assert torch.allclose(new.grad, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    assert stats["clipped_tokens"].item() == 2


def test_cispo_keeps_the_gradient_ppo_drops():
    """A positive-advantage token whose ratio is past the clip: PPO's gradient is zero, CISPO's
    is the clipped weight times the advantage."""
    old, new = torch.zeros(1, dtype=F64), torch.tensor([0.5], dtype=F64, requires_grad=True)
    adv, mask = torch.ones(1, dtype=F64), torch.ones(1, dtype=F64)
    ppo, _ = ppo_clip_loss(new, old, adv, mask, 0.2, 0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), new)
    cispo, _ = cispo_loss(new, old, adv, mask, 1.0, 0.2)
    (cispo_grad,) = torch.autograd.grad(cispo.sum(), new)
    assert ppo_grad.item() == 0.0 and cispo_grad.item() == pytest.approx(-1.2)


def test_cispo_trust_mask_drops_what_ppo_clip_drops():
    """The unified form's mask M: tokens PPO's clip leaves without gradient (A > 0 above
    1 + clip_high, A < 0 below 1 - clip_low) leave the loss; the others keep -sg(r̂)·A."""
    old = torch.log(torch.full((6,), 0.5, dtype=F64))
    probs = [0.9, 0.9, 0.3, 0.3, 0.55, 0.55]  # ratios 1.8, 1.8, 0.6, 0.6, 1.1, 1.1
    new = torch.log(torch.tensor(probs, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, -2.0], dtype=F64)
    mask = torch.ones(6, dtype=F64)
    loss, stats = cispo_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, trust_mask=True)
    loss.sum().backward()
    weight = [1.28, 1.28, 0.8, 0.8, 1.1, 1.1]
    kept = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # PPO drops (A > 0, r = 1.8) and (A < 0, r = 0.6)
    expected = [-w * a * k for w, a, k in zip(weight, adv.tolist(), kept)]
    assert torch.allclose(new.grad, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    assert stats["clipped_tokens"].item() == 2
    ppo, _ = ppo_clip_loss(new, old, adv, mask, 0.2, 0.28)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), new)
    assert [g == 0 for g in ppo_grad.tolist()] == [k == 0 for k in kept]


@pytest.mark.parametrize("overrides, message", [
    ({"is_level": "token"}, "already does"),
    ({"reject": "token", "reject_low": 3.0, "reject_high": 2.0}, "band"),
    ({"is_level": "sequence", "is_cap": 0.0}, "is_cap"),
])
def test_config_refuses_corrections_that_cannot_work(overrides, message):
    cfg = RootConfig()
    if "is_cap" in overrides or "reject" in overrides:
        cfg.algo.policy_loss = "ppo"
    for key, value in overrides.items():
        setattr(cfg.correction, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


# ---------------------------------------------------------------- through the learner
VOCAB = 24


def _stale_batch():
    """Responses whose engine logprobs differ from the learner's, sampled 0-3 versions ago."""
    trajs = []
    for i in range(8):
        resp = [5, 6, 7, 8] if i % 2 == 0 else [9, 10, 11, 12]
        behav = [-3.0 + 0.5 * ((i + t) % 5) for t in range(4)]
        trajs.append(Trajectory("p", i, [1, 2, 3], resp, behav, [3 - (i % 4)] * 4, "length"))
    return advantaged(trajs, [1.0 if i % 2 == 0 else -1.0 for i in range(8)])


def _learner(policy_loss="ppo", **correction):
    from megatron_rl.learner.learner import Learner

    cfg = RootConfig()
    cfg.learner.lr = 1e-3
    cfg.algo.policy_loss = policy_loss
    for key, value in correction.items():
        setattr(cfg.correction, key, value)
    validate(cfg)
    torch.manual_seed(0)
    return Learner(cfg, VOCAB)


def test_learner_without_correction_is_unchanged_and_with_it_drops_what_it_reports(megatron_world):
    plain = _learner().train_step(copy.deepcopy(_stale_batch()), 1.0, lr=1e-3, version=3)
    # A band that keeps everything: same loss and gradient norm, every token kept.
    wide = _learner(reject="token", reject_low=1e-9, reject_high=1e9).train_step(
        copy.deepcopy(_stale_batch()), 1.0, lr=1e-3, version=3)
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert abs(plain[key] - wide[key]) <= 1e-6 * max(1.0, abs(plain[key])), key
    assert wide["correction/rejected_fraction"] == 0.0 and wide["correction/kept_fraction"] == 1.0
    assert "correction/kept_fraction" not in plain

    # Versions 3, 2, 1, 0 against trained version 3: lags 0..3; a gap of 1 keeps half the rows.
    gap = _learner(max_version_gap=1).train_step(copy.deepcopy(_stale_batch()), 1.0, lr=1e-3, version=3)
    assert gap["correction/version_dropped_fraction"] == 0.5 and gap["correction/kept_fraction"] == 0.5

    weighted = _learner(is_level="token", is_cap=2.0).train_step(copy.deepcopy(_stale_batch()), 1.0, lr=1e-3,
                                                                version=3)
    assert 0.0 < weighted["correction/is_weight_mean"] <= 2.0
    assert abs(weighted["train/grad_norm"] - plain["train/grad_norm"]) > 1e-4  # the weight changed the step


def test_learner_trains_with_cispo(megatron_world):
    learner = _learner("cispo")
    trajs = _stale_batch()
    before = learner.compute_logprobs(trajs, 1.0)
    for _ in range(5):
        metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-2, version=3)
    after = learner.compute_logprobs(trajs, 1.0)
    assert sum(after[0]) > sum(before[0]) + 0.5 and sum(after[1]) < sum(before[1]) - 0.5
    assert math.isfinite(metrics["train/loss"])
