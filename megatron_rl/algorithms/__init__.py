"""Advantage estimators and policy losses: pure functions over tensors, registered by config name."""

from .advantages import (ADVANTAGE_ESTIMATORS, batch_whitened_advantages, compute_advantages,
                         group_relative_advantages, leave_one_out_advantages)
from .gae import clipped_value_loss, explained_variance, gae_advantages, masked_whiten
from .kl import kl_penalty
from .policy_loss import POLICY_LOSSES, ppo_clip_loss

__all__ = ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "batch_whitened_advantages", "clipped_value_loss",
           "compute_advantages", "explained_variance", "gae_advantages",
           "group_relative_advantages", "kl_penalty", "leave_one_out_advantages", "masked_whiten",
           "ppo_clip_loss"]
