"""Verifiable rewards and the pool that runs them with a timeout."""

from .runner import RewardRunner
from .verifiers import REWARDS, digit_match, gsm8k_exact

__all__ = ["REWARDS", "RewardRunner", "digit_match", "gsm8k_exact"]
