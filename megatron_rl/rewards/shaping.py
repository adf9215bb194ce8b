"""Reward shaping applied on top of a verifier's score: pure functions."""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    With L_max = ``max_length`` and L_cache = ``buffer``: 0 while length <= L_max - L_cache, then
    falling linearly to -1 at L_max, and -1 beyond; times ``factor``. ``buffer`` = 0 disables it.
    """
    if buffer <= 0:
        return 0.0
    if buffer > max_length:
        raise ValueError(f"overlong buffer {buffer} exceeds the maximum length {max_length}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return factor * (start - length) / buffer
    return -factor
