"""Verifiable rewards and the pool that runs them with a timeout."""

from .runner import RewardRunner, score_groups
from .math_verifier import math_equal
from .verifiers import REWARDS, digit_match, gsm8k_exact

__all__ = ["REWARDS", "RewardRunner", "score_groups", "digit_match", "gsm8k_exact", "math_equal"]
