"""Advantage estimators: pure functions over reward tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Sequence

import torch

from ..registry import Registry

if TYPE_CHECKING:
    from ..config.schema import AlgoConfig
    from ..types import Trajectory


def group_relative_advantages(rewards: torch.Tensor, normalize_by_std: bool = True,
                              eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages for rewards shaped [groups, group_size].

    A_i = (r_i - mean(group)) / (std(group) + eps), with the unbiased std as in the GRPO paper
    (DeepSeekMath, Shao et al. 2024). ``normalize_by_std=False`` only centres (Dr.GRPO,
    Liu et al. 2025). A group whose rewards are all equal gets zero advantages.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_by_std:
        return centred
    if rewards.shape[1] < 2:
        raise ValueError("group-normalised advantages need group_size >= 2")
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def leave_one_out_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO advantages for rewards shaped [groups, group_size] (Ahmadian et al. 2024, after
    Kool et al. 2019): each sample's baseline is the mean reward of the *other* samples of its
    group, A_i = r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) · (r_i - mean).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    n = rewards.shape[1]
    if n < 2:
        raise ValueError("leave-one-out advantages need group_size >= 2")
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - others


def batch_whitened_advantages(rewards: torch.Tensor, lengths: torch.Tensor, subtract_group_mean: bool = False,
                              eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025) for outcome rewards shaped [groups, group_size].

    Every response token carries its sequence's return; the returns are whitened over all tokens
    of the batch (global, not per group): A = (R - mean_tokens) / (std_tokens + eps), where the
    token-level mean and std weight each sequence by its length ``lengths`` [groups, group_size].
    ``subtract_group_mean`` first subtracts each group's mean reward (REINFORCE++-baseline).
    Zero-length sequences get advantage 0 (they have no token to carry it).
    """
    if rewards.shape != lengths.shape or rewards.dim() != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)} and lengths {tuple(lengths.shape)} must both be "
                         "[groups, group_size]")
    returns = rewards - rewards.mean(dim=1, keepdim=True) if subtract_group_mean else rewards
    weights = lengths.to(returns.dtype)
    total = weights.sum()
    if total <= 0:
        return torch.zeros_like(returns)
    mean = (weights * returns).sum() / total
    var = (weights * (returns - mean) ** 2).sum() / total
    return torch.where(weights > 0, (returns - mean) / (var.sqrt() + eps), torch.zeros_like(returns))


# algo.name -> the function computing its sequence advantages, called as
# fn(rewards [groups, group_size], lengths [groups, group_size], eps, normalize_by_std).
AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(rewards: torch.Tensor, lengths: torch.Tensor, eps: float, normalize_by_std: bool) -> torch.Tensor:
    return group_relative_advantages(rewards, normalize_by_std, eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def _dr_grpo(rewards: torch.Tensor, lengths: torch.Tensor, eps: float, normalize_by_std: bool) -> torch.Tensor:
    return group_relative_advantages(rewards, normalize_by_std=False)


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(rewards: torch.Tensor, lengths: torch.Tensor, eps: float, normalize_by_std: bool) -> torch.Tensor:
    return leave_one_out_advantages(rewards)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def _reinforce_pp(rewards: torch.Tensor, lengths: torch.Tensor, eps: float, normalize_by_std: bool) -> torch.Tensor:
    return batch_whitened_advantages(rewards, lengths, False, eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def _reinforce_pp_baseline(rewards: torch.Tensor, lengths: torch.Tensor, eps: float,
                           normalize_by_std: bool) -> torch.Tensor:
    return batch_whitened_advantages(rewards, lengths, True, eps)


def compute_advantages(name: str, rewards: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-6,
                       normalize_by_std: bool = True) -> torch.Tensor:
    """Sequence advantages of one batch for the estimator ``algo.name``."""
    return ADVANTAGE_ESTIMATORS.get(name)(rewards, lengths, eps, normalize_by_std)


def runs_of(group: Sequence["Trajectory"]) -> List[List["Trajectory"]]:
    """A group's trajectories by sample: one each for single-turn samples; an agent run whose
    turns did not all extend one token sequence leaves several with the same sample index."""
    runs: Dict[int, List["Trajectory"]] = {}
    for traj in group:
        runs.setdefault(traj.sample_index, []).append(traj)
    return list(runs.values())


def sample_advantages(groups: Sequence[Sequence["Trajectory"]], rewards: Sequence[Sequence[float]],
                      algo: "AlgoConfig") -> List[List[float]]:
    """Each trajectory's sequence advantage (``[groups][trajectories]``, like ``groups``) from its
    group's ``rewards`` (one per trajectory, the ones the step trains on) with ``algo.name``'s
    estimator (``algo`` is the AlgoConfig). The estimator sees one reward per sample (an agent
    run's trajectories share it and its length is their trained tokens together); each trajectory
    gets its sample's advantage times its ``advantage_scale``. PPO with a critic (gae) is per
    token and needs the critic's values: learner/critic.py computes those."""
    flat = [t for grp in groups for t in grp]
    index, at = [], 0
    for grp in groups:
        index.append(range(at, at + len(grp)))
        at += len(grp)
    out = row_advantages(index, [t.sample_index for t in flat], [sum(t.loss_mask) for t in flat],
                         [t.advantage_scale for t in flat], [r for row in rewards for r in row], algo)
    return [[out[i] for i in grp] for grp in index]


def row_advantages(groups: Sequence[Sequence[int]], sample_index: Sequence[int], trained_tokens: Sequence[float],
                   advantage_scale: Sequence[float], rewards: Sequence[float], algo: "AlgoConfig") -> List[float]:
    """``sample_advantages`` from a few numbers per row (rows indexed 0..n-1; ``groups`` lists
    each group's rows): what every learner rank knows of the rows it does not hold."""
    if algo.name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"algo.name={algo.name!r} is not a group estimator (those: {ADVANTAGE_ESTIMATORS.names()}); "
                         "its advantages come from a critic")
    runs = []  # per group, its samples' rows (an agent run's trajectories are one sample)
    for grp in groups:
        by_sample: Dict[int, List[int]] = {}
        for i in grp:
            by_sample.setdefault(sample_index[i], []).append(i)
        runs.append(list(by_sample.values()))
    run_rewards = torch.tensor([[rewards[run[0]] for run in grp] for grp in runs], dtype=torch.float64)
    lengths = torch.tensor([[sum(trained_tokens[i] for i in run) for run in grp] for grp in runs], dtype=torch.float64)
    adv = compute_advantages(algo.name, run_rewards, lengths, algo.adv_eps, algo.normalize_adv_by_std)
    out = [0.0] * len(sample_index)
    for grp, row in zip(runs, adv.tolist()):
        for run, value in zip(grp, row):
            for i in run:
                out[i] = value * advantage_scale[i]
    return out
