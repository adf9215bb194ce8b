"""KL estimators between the policy and a reference, per token (Schulman, "Approximating KL
Divergence", 2020). With logr = logp_ref - logp (samples drawn from the policy):
k1 = -logr, k2 = logr² / 2, k3 = exp(logr) - 1 - logr (unbiased, non-negative)."""

from __future__ import annotations

import torch


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # Clamp as verl/OpenRLHF do: exp of a large log-ratio would overflow in low precision.
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def kl_shaped_reward(reward: float, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, coef: float,
                     estimator: str = "k1") -> float:
    """KL in the reward (instead of in the loss): the sequence's score minus coef times the summed
    per-token KL estimate between the policy that is trained and the reference, as PPO-RLHF
    (Ouyang et al. 2022) and REINFORCE++ put it; group-relative estimators then see the penalty."""
    return reward - coef * float(kl_penalty(logprobs, ref_logprobs, estimator).sum())
