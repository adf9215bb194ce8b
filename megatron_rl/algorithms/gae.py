"""PPO with a learned critic: generalised advantage estimation and the value loss, as pure
functions over right-padded per-token tensors [batch, tokens]."""

from __future__ import annotations

from typing import Dict, Tuple

import torch


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float = 1.0,
                   lam: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE(γ, λ) (Schulman et al. 2016) for rows of response tokens, right padded.

    δ_t = r_t + γ·V_{t+1} - V_t with V = 0 after a row's last valid token (the episode ends there),
    A_t = Σ_l (γλ)^l δ_{t+l}, and the critic's targets R_t = A_t + V_t. ``valid`` [b, t] is 1 for the
    row's tokens (a prefix of the row), 0 for padding; padding gets A = R = 0.
    An outcome reward is r_t = 0 except at the row's last token.
    """
    if not (rewards.shape == values.shape == valid.shape) or rewards.dim() != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and valid "
                         f"{tuple(valid.shape)} must all be [batch, tokens]")
    valid = valid.to(values.dtype)
    values = values * valid
    rewards = rewards * valid
    advantages = torch.zeros_like(values)
    if values.shape[1] == 0:  # a batch of empty responses
        return advantages, advantages.clone()
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # Padding (valid = 0) resets the recursion, so a row's last token sees V_{T} = 0.
        running = (delta + gamma * lam * running) * valid[:, t]
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, (advantages + values) * valid


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (population std), 0 outside the mask: PPO's
    per-batch advantage normalisation."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    if count == 0:
        return torch.zeros_like(values)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) / (var.sqrt() + eps) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip: float = 0.2) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token critic loss ½·max((V - R)², (V_old + clip(V - V_old, ±clip) - R)²), PPO's
    clipped value objective (as in the PPO2 baselines code); ``clip`` = 0 gives ½(V - R)².
    Statistics are sums over masked tokens."""
    unclipped = (values - returns).square()
    if clip > 0:
        clipped_v = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_v - returns).square()
        loss = 0.5 * torch.maximum(unclipped, clipped)
        clip_hits = (clipped > unclipped).to(values.dtype)
    else:
        loss = 0.5 * unclipped
        clip_hits = torch.zeros_like(values)
    with torch.no_grad():
        stats = {"value_clipped_tokens": (clip_hits * mask).sum(),
                 "value_error_sq_sum": (unclipped * mask).sum()}
    return loss * mask, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over masked tokens: 1 is a perfect critic, 0 no better than the mean."""
    mask = mask.to(returns.dtype)
    count = mask.sum()
    if count < 2:
        return 0.0
    mean_r = (returns * mask).sum() / count
    var_r = (((returns - mean_r) * mask) ** 2).sum() / count
    resid = (returns - values) * mask
    var_e = ((resid - resid.sum() / count) * mask).square().sum() / count
    return float(1.0 - var_e / var_r) if var_r > 0 else 0.0
