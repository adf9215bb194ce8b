"""Advantage estimators against float64 references written directly from the published formulas
(loops over plain Python floats, no shared code with the implementation)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import (batch_whitened_advantages, compute_advantages,
                                    leave_one_out_advantages)

rewards_st = st.lists(st.lists(st.floats(-3, 3), min_size=2, max_size=6), min_size=1, max_size=5).filter(
    lambda rows: len({len(r) for r in rows}) == 1)


def rloo_reference(rows):
    # Ahmadian et al. 2024, eq. (RLOO): baseline_i = 1/(k-1) Σ_{j≠i} r_j.
    out = []
    for row in rows:
        k = len(row)
        out.append([r - sum(row[j] for j in range(k) if j != i) / (k - 1) for i, r in enumerate(row)])
    return out


def reinforce_pp_reference(rows, lens, baseline, eps=1e-6):
    # Hu 2025: each token carries its sequence's return; normalise over all tokens of the batch.
    returns = [[r - (sum(row) / len(row) if baseline else 0.0) for r in row] for row in rows]
    tokens = [ret for row, lrow in zip(returns, lens) for ret, n in zip(row, lrow) for _ in range(n)]
    if not tokens:
        return [[0.0] * len(row) for row in rows]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / len(tokens))
    return [[(ret - mean) / (std + eps) if n else 0.0 for ret, n in zip(row, lrow)]
            for row, lrow in zip(returns, lens)]


@settings(max_examples=300, deadline=None)
@given(rewards_st)
def test_rloo_matches_reference(rows):
    ours = leave_one_out_advantages(torch.tensor(rows, dtype=torch.float64))
    assert torch.allclose(ours, torch.tensor(rloo_reference(rows), dtype=torch.float64), atol=1e-12)


@settings(max_examples=300, deadline=None)
@given(rewards_st, st.data(), st.booleans())
def test_reinforce_pp_matches_reference(rows, data, baseline):
    lens = [[data.draw(st.integers(0, 7)) for _ in row] for row in rows]
    ours = batch_whitened_advantages(torch.tensor(rows, dtype=torch.float64),
                                     torch.tensor(lens, dtype=torch.float64), baseline)
    ref = torch.tensor(reinforce_pp_reference(rows, lens, baseline), dtype=torch.float64)
    # Two summation orders of the mean differ by up to ~tokens ulp of the largest reward, and the
    # division by (std + 1e-6) magnifies that by up to 1e6 when every return is equal (std ~ 0).
    scale = max([1.0] + [abs(r) for row in rows for r in row])
    tokens = sum(sum(lrow) for lrow in lens)
    atol = 1e-9 + 2.3e-16 / 1e-6 * scale * max(1, tokens)
    assert torch.allclose(ours, ref, atol=atol), (ours, ref)


def test_hand_computed_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    # RLOO: 1 - (0+0+1)/3 = 2/3; 0 - 2/3 = -2/3.
    assert leave_one_out_advantages(r)[0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # Dr.GRPO: centred only.
    assert compute_advantages("dr_grpo", r, torch.ones_like(r)).tolist() == [[0.5, -0.5, -0.5, 0.5]]
    # REINFORCE++ with lengths 3,1,1,1: token returns [1,1,1,0,0,1]: mean 2/3, std sqrt(2)/3.
    lens = torch.tensor([[3.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    std = math.sqrt(2) / 3
    expected = [[(1 - 2 / 3) / std, (0 - 2 / 3) / std, (0 - 2 / 3) / std, (1 - 2 / 3) / std]]
    assert batch_whitened_advantages(r, lens, eps=0.0)[0].tolist() == pytest.approx(expected[0])


def test_all_equal_rewards_and_empty_responses_give_zero():
    equal = torch.full((2, 4), 0.7, dtype=torch.float64)
    ones = torch.ones_like(equal)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        assert compute_advantages(name, equal, ones).abs().max() <= 1e-12, name
    # REINFORCE++ without a baseline: all returns equal the token mean -> zero as well.
    assert compute_advantages("reinforce_pp", equal, ones).abs().max() <= 1e-12
    # Every response empty: nothing to whiten, zeros rather than NaN.
    assert compute_advantages("reinforce_pp", equal, torch.zeros_like(equal)).abs().max() == 0.0


def test_bad_shapes_and_names_raise():
    with pytest.raises(ValueError, match="group_size >= 2"):
        leave_one_out_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="must both be"):
        batch_whitened_advantages(torch.ones(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo_gae", torch.ones(2, 2), torch.ones(2, 2))
