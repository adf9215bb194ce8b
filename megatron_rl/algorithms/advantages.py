"""Advantage estimators: pure functions over reward tensors."""

from __future__ import annotations

import torch


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
