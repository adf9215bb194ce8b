"""Rollout correction: weights and masks for tokens the rollout engine sampled from a policy that
is not the one the learner scores them with.

The engine's policy π_behav differs from the learner's proximal policy π_prox (the weights about
to be updated) for two reasons: staleness (asynchronous rollouts sample with older weights) and
mismatch (other kernels, bf16 rounding, a different framework). The per-token ratio
ρ_t = π_prox(y_t) / π_behav(y_t) measures both. This module turns it into

- an importance weight (truncated IS, Ionides 2008; TIS for LLM RL, Yao et al. 2025):
  ``is_level=token`` weights each token by min(ρ_t, cap); ``sequence`` weights every token of a
  response by min(Π_t ρ_t, cap), which also corrects for the prefixes the engine's policy chose;
- a rejection mask (masked IS): tokens (``reject=token``) or whole responses (``sequence``: the
  product of the ratios; ``geometric``: their geometric mean exp(mean_t log ρ_t), a
  length-independent measure) whose ratio lies outside [low, high] are left out of the loss.
  IcePop (Ling Team 2025) is ``reject=token`` with [0.5, 5] together with ``is_level=token``
  and cap 5: tokens inside the band keep their weight ρ_t, the others are masked;
- a veto: a response with any token of ρ_t below ``veto_below`` is left out whole (a token the
  learner finds far less likely than the engine did usually means a broken sample);
- a version-gap mask: tokens sampled more than ``max_version_gap`` policy versions before the
  weights being trained are left out (each token's version is recorded by the engine).

Ratios are computed in log space and kept within exp(±20) before exponentiation (a product of
thousands of ratios would overflow). Everything here is detached: corrections weight and mask
the loss, they are not trained through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..errors import ConfigError

# |log ratio| bound before exponentiation: exp(20) ~ 5e8.
_LOG_RATIO_BOUND = 20.0

IS_LEVELS = ("none", "token", "sequence")
REJECT_LEVELS = ("none", "token", "sequence", "geometric")


@dataclass(frozen=True)
class Correction:
    """What to do with the π_prox / π_behav ratios (see the module docstring)."""

    is_level: str = "none"
    is_cap: float = 2.0
    reject: str = "none"
    reject_low: Optional[float] = None  # None: 1 / reject_high
    reject_high: float = 2.0
    veto_below: float = 0.0
    max_version_gap: int = 0

    @property
    def active(self) -> bool:
        return (self.is_level != "none" or self.reject != "none" or self.veto_below > 0
                or self.max_version_gap > 0)

    @property
    def band(self) -> Tuple[float, float]:
        """The [low, high] band of ratios that ``reject`` keeps."""
        low = self.reject_low if self.reject_low is not None else 1.0 / self.reject_high
        return low, self.reject_high


def rollout_correction(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       correction: Correction, version_lag: Optional[torch.Tensor] = None,
                       ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """(weight, keep, stats) for rows [b, s] of response tokens.

    ``weight``: the per-token importance weight (1 without ``is_level``), zero outside ``mask``.
    ``keep``: ``mask`` without the tokens the rejection, veto and version-gap masks drop.
    ``version_lag``: per token, how many versions older than the trained weights its sampling
    policy was (needed for ``max_version_gap``).
    ``stats`` (sums over ``mask``'s tokens, for per-token means): ``is_weight_sum`` (the weight
    over the kept tokens), ``rejected_tokens``, ``vetoed_tokens``, ``version_dropped_tokens``
    (each token counted by the first mask that drops it, in that order), ``kept_tokens``.
    """
    if correction.max_version_gap > 0 and version_lag is None:
        raise ValueError("max_version_gap needs each token's version lag")
    mask = mask.to(proximal_logprobs.dtype)
    log_ratio = ((proximal_logprobs - behaviour_logprobs).detach() * mask).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    lengths = mask.sum(dim=1, keepdim=True)
    log_seq = (log_ratio * mask).sum(dim=1, keepdim=True).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)

    if correction.is_level == "token":
        weight = torch.exp(log_ratio).clamp(max=correction.is_cap)
    elif correction.is_level == "sequence":
        weight = torch.exp(log_seq).clamp(max=correction.is_cap).expand_as(log_ratio)
    elif correction.is_level == "none":
        weight = torch.ones_like(log_ratio)
    else:
        raise ValueError(f"unknown importance-weight level {correction.is_level!r}; choose one of {IS_LEVELS}")
    weight = weight * mask

    keep = mask.clone()
    stats: Dict[str, torch.Tensor] = {}
    if correction.reject != "none":
        low, high = correction.band
        if correction.reject == "token":
            level = log_ratio
        elif correction.reject == "sequence":
            level = log_seq.expand_as(log_ratio)
        elif correction.reject == "geometric":
            level = (log_seq / lengths.clamp(min=1)).expand_as(log_ratio)
        else:
            raise ValueError(f"unknown rejection level {correction.reject!r}; choose one of {REJECT_LEVELS}")
        inside = (level >= math.log(low)) & (level <= math.log(high)) if low > 0 else level <= math.log(high)
        stats["rejected_tokens"] = (keep * ~inside).sum()
        keep = keep * inside
    if correction.veto_below > 0:
        # On the raw ratios (before the ±20 bound); tokens outside the mask never veto.
        raw = (proximal_logprobs - behaviour_logprobs).detach()
        vetoed = ((raw < math.log(correction.veto_below)) & (mask > 0)).any(dim=1, keepdim=True)
        stats["vetoed_tokens"] = (keep * vetoed).sum()
        keep = keep * ~vetoed
    if correction.max_version_gap > 0:
        too_old = version_lag > correction.max_version_gap
        stats["version_dropped_tokens"] = (keep * too_old).sum()
        keep = keep * ~too_old
    stats["is_weight_sum"] = (weight * keep).sum()
    stats["kept_tokens"] = keep.sum()
    return weight, keep, stats


def check_correction(cfg) -> None:
    """Rollout-correction values (correction.*) that cannot work together."""
    c = cfg.correction
    if c.is_level != "none" and cfg.algo.policy_loss == "decoupled":
        raise ConfigError(f"correction.is_level={c.is_level} weights tokens by π_prox/π_behav, which "
                          "algo.policy_loss=decoupled already does (algo.behav_imp_weight_cap): use it with "
                          "algo.policy_loss=ppo|gspo|cispo, or correction.is_level=none")
    if c.is_level != "none" and not c.is_cap > 0:
        raise ConfigError(f"correction.is_cap={c.is_cap} must be > 0 (e.g. 2)")
    if c.reject != "none":
        low = c.reject_low if c.reject_low is not None else (1.0 / c.reject_high if c.reject_high > 0 else 0.0)
        if not (c.reject_high > 0 and 0 <= low < c.reject_high):
            raise ConfigError(f"correction.reject_low={c.reject_low} and correction.reject_high={c.reject_high} "
                              "must make a band 0 <= low < high (e.g. reject_low=0.5 reject_high=2)")
