"""Admission control for asynchronous rollouts (the rule of DESIGN.md, after AReaL).

A rollout group may start only while ``capacity(v) > 0``:

    capacity(v) = min(max_concurrent - running, (η + v + 1)·B - (accepted + running))

v is the current policy version, B the groups per training batch, η ``scheduler.max_staleness``.
``accepted`` counts groups that finished and were kept, ``running`` groups in flight. With η = 0
exactly one batch is generated per version: plain synchronous on-policy RL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass
class StalenessManager:
    max_staleness: int
    groups_per_batch: int
    max_concurrent: int
    accepted: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.groups_per_batch < 1 or self.max_concurrent < 1:
            raise ValueError(f"invalid staleness settings: {self}")

    def capacity(self, version: int) -> int:
        by_concurrency = self.max_concurrent - self.running
        by_staleness = (self.max_staleness + version + 1) * self.groups_per_batch - (self.accepted + self.running)
        return min(by_concurrency, by_staleness)

    def on_submit(self) -> None:
        self.running += 1

    def on_accept(self) -> None:
        """A running group finished and went to the buffer."""
        self.running -= 1
        self.accepted += 1

    def on_reject(self) -> None:
        """A running group failed (engine error, abort): its prompt goes back to the queue."""
        self.running -= 1

    def on_evict(self) -> None:
        """An accepted group was found too stale to train on; its prompt goes back to the queue."""
        self.accepted -= 1


def schedulable(deadlines: Iterable[int], next_version: int, groups_per_batch: int) -> bool:
    """Whether groups with these ``deadlines`` (the last policy version each may be trained at,
    its oldest token's version + η) can all be trained in time: ``groups_per_batch`` per batch from
    version ``next_version`` on, earliest deadline first. Earliest-deadline-first is optimal for
    unit jobs like these, so False means no order of batches can keep every one of them."""
    for i, deadline in enumerate(sorted(deadlines)):
        if deadline < next_version + i // groups_per_batch:
            return False
    return True
