"""Advantage estimators and policy losses: pure functions over tensors."""

from .advantages import group_relative_advantages
from .kl import kl_penalty
from .policy_loss import ppo_clip_loss

__all__ = ["group_relative_advantages", "kl_penalty", "ppo_clip_loss"]
