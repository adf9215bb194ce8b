"""Policy-gradient losses: pure functions of per-token tensors. Each returns per-token losses
(to be summed under the mask and divided by the token count by the caller) and statistics."""

from __future__ import annotations

from typing import Dict, Tuple

import torch


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                  ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low/high clip (DAPO's clip-higher).

    r = exp(logp - logp_old); loss_t = -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A).
    Statistics are sums over masked tokens: ``clipped`` counts tokens where the clipped term won.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        stats = {
            "clipped_tokens": ((clipped < unclipped).float() * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            # k3 estimate of KL(old || new) (Schulman 2020), a health signal for the update size.
            "approx_kl_sum": (((ratio - 1) - (logprobs - old_logprobs)) * mask).sum(),
        }
    return loss * mask, stats
