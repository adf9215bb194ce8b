"""Policy-gradient losses: pure functions of per-token tensors. Each returns per-token losses
(to be summed under the mask and divided by the token count by the caller) and statistics."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Dict, Tuple

import torch

from ..registry import Registry

if TYPE_CHECKING:
    from ..config.schema import AlgoConfig


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float = 0.0,
                  ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low/high clip (DAPO's clip-higher).

    r = exp(logp - logp_old); loss_t = -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A).
    ``dual_clip`` = c > 1 also bounds the loss of negative advantages (Ye et al. 2020):
    for A < 0, loss_t = -max(min(r·A, clip(r)·A), c·A), so a huge ratio cannot blow the step up.
    Statistics are sums over masked tokens: ``clipped`` counts tokens where the clipped term won.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if dual_clip:
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, dual_clip * advantages), surrogate)
    loss = -surrogate
    with torch.no_grad():
        stats = {
            "clipped_tokens": ((clipped < unclipped).float() * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            # k3 estimate of KL(old || new) (Schulman 2020), a health signal for the update size.
            "approx_kl_sum": (((ratio - 1) - (logprobs - old_logprobs)) * mask).sum(),
        }
    return loss * mask, stats


def decoupled_ppo_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
                       behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       clip_low: float = 0.2, clip_high: float = 0.2,
                       behaviour_weight_cap: float = 0.0, dual_clip: float = 0.0,
                       weight_level: str = "token",
                       ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Decoupled PPO for off-policy (stale) samples (Fu et al. 2025, AReaL; Hilton et al. 2022).

    The trust region is centred on the proximal policy π_prox (the learner's weights before this
    update) instead of the behaviour policy π_behav that sampled the tokens:
      r = π_θ / π_prox,  w = π_prox / π_behav,
      loss_t = -w · min(r·A, clip(r, 1-clip_low, 1+clip_high)·A).
    ``weight_level="token"``: w per token; tokens whose w exceeds ``behaviour_weight_cap`` (> 0) are
    left out of the loss (counted in ``capped_tokens``), as AReaL does. ``"sequence"``: w is the
    whole response's ratio Π_t π_prox/π_behav (rows are sequences), truncated at the cap (> 0) and
    shared by its tokens: it also corrects for the prefixes (states) the stale policy visited, which
    per-token ratios ignore. With π_behav = π_prox this is PPO.
    """
    log_w = (proximal_logprobs - behaviour_logprobs).detach() * mask
    keep = mask
    if weight_level == "sequence":
        log_w_seq = log_w.sum(dim=1, keepdim=True)
        if behaviour_weight_cap > 0:
            log_w_seq = log_w_seq.clamp(max=math.log(behaviour_weight_cap))
        weight = torch.exp(log_w_seq).expand_as(log_w)
        capped = (mask * (log_w.sum(dim=1, keepdim=True) > log_w_seq).to(mask.dtype))
    elif weight_level == "token":
        weight = torch.exp(log_w)
        if behaviour_weight_cap > 0:
            keep = mask * (weight <= behaviour_weight_cap).to(mask.dtype)
        capped = mask - keep
    else:
        raise ValueError(f"unknown importance weight level {weight_level!r}; choose token or sequence")
    loss, stats = ppo_clip_loss(logprobs, proximal_logprobs, advantages, keep, clip_low, clip_high, dual_clip)
    with torch.no_grad():
        stats["capped_tokens"] = capped.sum()
        stats["behav_weight_sum"] = (weight * mask).sum()
    return loss * weight, stats


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4,
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): the importance ratio and its clip are per sequence.

    Rows are sequences. s_i = exp(mean_t (logp_it - logp_old_it)) over the row's masked tokens and
    J_i = min(s_i·A_i, clip(s_i, 1-clip_low, 1+clip_high)·A_i). Written per token in the GSPO-token
    form, s_it = sg(s_i) · exp(logp_it - sg(logp_it)): every token of a row carries the value -J_i,
    and the row's token mean has the gradient of -J_i. Use it with
    ``algo.loss_agg_mode=seq-mean-token-mean`` (each sequence weighs the same, as in the paper).
    """
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / lengths
    seq_ratio = torch.exp(seq_log_ratio.detach())
    token_ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
    unclipped = token_ratio * advantages
    clipped = torch.clamp(token_ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        ratio = seq_ratio.expand_as(logprobs)
        stats = {
            "clipped_tokens": ((clipped < unclipped).float() * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "approx_kl_sum": (((ratio - 1) - seq_log_ratio) * mask).sum(),
        }
    return loss * mask, stats


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, clip_low: float = 1.0, clip_high: float = 4.0, trust_mask: bool = False,
               ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, MiniMax 2025): a REINFORCE gradient weighted by the clipped, detached
    importance ratio, so no token's gradient is ever dropped (PPO's clip zeroes the gradient of
    tokens outside the trust region, often the rare "fork" tokens of a reasoning trace).

      r = π_θ / π_old,  loss_t = -sg(clip(r, 1-clip_low, 1+clip_high)) · A · log π_θ(y_t).

    Written as -sg(r̂)·A·exp(logp - sg(logp)): the same gradient, and the value -r̂·A (the
    surrogate's at r = 1) instead of a log-probability-sized number. The paper bounds only the
    top (clip_low = 1 leaves the bottom at 0). ``clipped_tokens`` counts tokens whose weight was
    clipped, in either direction.

    ``trust_mask``: the paper's unified form (its eq. 7), loss_t · M_t with M_t = 0 where PPO's
    clip would drop the token's gradient (A > 0 and r > 1 + clip_high, or A < 0 and r < 1 -
    clip_low); ``clipped_tokens`` then counts the masked tokens."""
    ratio = torch.exp((logprobs - old_logprobs).detach())
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantages * torch.exp(logprobs - logprobs.detach())
    clipped = weight != ratio
    if trust_mask:
        clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
        loss = torch.where(clipped, torch.zeros_like(loss), loss)
    with torch.no_grad():
        stats = {
            "clipped_tokens": (clipped.float() * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "approx_kl_sum": (((ratio - 1) - (logprobs - old_logprobs)) * mask).sum(),
        }
    return loss * mask, stats


# algo.policy_loss -> its per-token loss, called as
# fn(logprobs, proximal_logprobs, behav_logprobs, advantages, mask, algo) -> (per-token loss, stats):
# one signature, so the learner calls whichever is configured the same way. ``proximal_logprobs`` are
# the proximal policy's (the learner's weights before this update), ``behav_logprobs`` the
# engine's that sampled the tokens; ``algo`` is the AlgoConfig, for the loss's own settings.
PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "AlgoConfig"],
                      Tuple[torch.Tensor, Dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


@POLICY_LOSSES.register("decoupled")
def _decoupled(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
               advantages: torch.Tensor, mask: torch.Tensor, algo: "AlgoConfig",
               ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return decoupled_ppo_loss(logprobs, proximal_logprobs, behav_logprobs, advantages, mask, algo.clip_low,
                              algo.clip_high, algo.behav_imp_weight_cap, algo.dual_clip, algo.behav_weight_level)


@POLICY_LOSSES.register("ppo")
def _ppo(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
         advantages: torch.Tensor, mask: torch.Tensor, algo: "AlgoConfig",
         ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return ppo_clip_loss(logprobs, proximal_logprobs, advantages, mask, algo.clip_low, algo.clip_high, algo.dual_clip)


@POLICY_LOSSES.register("gspo")
def _gspo(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
          advantages: torch.Tensor, mask: torch.Tensor, algo: "AlgoConfig",
          ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return gspo_loss(logprobs, proximal_logprobs, advantages, mask, algo.clip_low, algo.clip_high)


@POLICY_LOSSES.register("cispo")
def _cispo(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
           advantages: torch.Tensor, mask: torch.Tensor, algo: "AlgoConfig",
           ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return cispo_loss(logprobs, proximal_logprobs, advantages, mask, algo.clip_low, algo.clip_high,
                      algo.cispo_trust_mask)


@POLICY_LOSSES.register("nll")
def _nll(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
         advantages: torch.Tensor, mask: torch.Tensor, algo: "AlgoConfig",
         ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Supervised fine-tuning's loss: the negative log-likelihood of each response token,
    weighted by its advantage (1 for SFT). No ratio, no clip."""
    with torch.no_grad():
        zero = (logprobs * 0).sum()
        stats = {"clipped_tokens": zero, "ratio_sum": mask.sum(), "approx_kl_sum": zero}
    return -advantages * logprobs * mask, stats


# algo.loss_agg_mode: how per-token losses become one number (what the gradient is averaged over).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   norm_length: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the aggregated loss of rows [b, s] of per-token losses.

    Returned as a pair so that micro-batches add up: the loss of a whole batch is
    sum(numerators) / sum(denominators), which is how Megatron's per-token loss mode divides.
      token-mean:              Σ_it l_it / Σ_it m_it            (every token weighs the same; DAPO)
      seq-mean-token-mean:     Σ_i (Σ_t l_it / |o_i|) / N       (every sequence weighs the same; GRPO paper)
      seq-mean-token-sum:      Σ_i Σ_t l_it / N
      seq-mean-token-sum-norm: Σ_i Σ_t l_it / (N · norm_length)  (Dr.GRPO: a constant, e.g. the
                               generation budget, instead of each response's own length)
    N counts rows with at least one masked token (filler rows count for nothing).
    """
    masked = token_loss * mask
    if mode == "token-mean":
        return masked.sum(), mask.sum()
    lengths = mask.sum(dim=1)
    rows = (lengths > 0).to(token_loss.dtype)
    if mode == "seq-mean-token-mean":
        per_row = masked.sum(dim=1) / lengths.clamp(min=1)
        return (per_row * rows).sum(), rows.sum()
    if mode == "seq-mean-token-sum":
        return masked.sum(), rows.sum()
    if mode == "seq-mean-token-sum-norm":
        return masked.sum(), rows.sum() * norm_length
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGG_MODES}")
