"""Which rows of a step's batch each data-parallel replica trains, and what every rank knows of
the whole batch without holding its tokens.

A batch of ``n`` sequences is cut into ``learner.mini_batches`` contiguous mini-batches (one
optimizer step each); each mini-batch is shared out over the replicas in contiguous slices
whose sizes differ by at most one. A replica's share is the union of its slices, mini-batch by
mini-batch: it is all the replica ever computes on, so the driver sends it those rows and no
others (learner/group.py). What the algorithms need of the other rows (rewards, groups, trained
token counts for group-relative advantages) is a few numbers per row: ``BatchIndex``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..types import Trajectory, token_count


def dp_bounds(n: int, dp: int, rank: int) -> Tuple[int, int]:
    """[start, end) of replica ``rank``'s share of ``n`` items: contiguous, sizes differ by <= 1."""
    base, extra = divmod(n, dp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def minibatch_bounds(n: int, mini_batches: int) -> List[Tuple[int, int]]:
    """[start, end) of each mini-batch of a batch of ``n`` sequences."""
    per_mini = max(1, math.ceil(n / max(mini_batches, 1)))
    return [(start, min(start + per_mini, n)) for start in range(0, n, per_mini)]


def replica_rows(n: int, mini_batches: int, dp: int, rank: int) -> Tuple[List[int], List[Tuple[int, int]]]:
    """Replica ``rank``'s rows of a batch of ``n`` (global indices, in training order) and the
    [start, end) of each of its mini-batches within them. ValueError when a mini-batch has
    fewer sequences than there are replicas (each must run every step's collectives)."""
    rows: List[int] = []
    local: List[Tuple[int, int]] = []
    for start, end in minibatch_bounds(n, mini_batches):
        if end - start < dp:
            raise ValueError(f"a batch of {end - start} sequences cannot be split over {dp} data-parallel "
                             f"replicas: give each at least one (more groups per batch or fewer replicas)")
        lo, hi = dp_bounds(end - start, dp, rank)
        local.append((len(rows), len(rows) + hi - lo))
        rows.extend(range(start + lo, start + hi))
    return rows, local


@dataclass(frozen=True)
class BatchIndex:
    """What every learner rank knows of every row of the step's batch (a few numbers each, the
    same on every rank) and which of them are this rank's own (``rows``, global indices in the
    order of the rank's trajectories; ``minibatches``: their [start, end) per optimizer step)."""

    groups: Tuple[Tuple[int, ...], ...]
    sample_index: Tuple[int, ...]
    rewards: Tuple[float, ...]
    trained_tokens: Tuple[int, ...]
    advantage_scale: Tuple[float, ...]
    teachers: Tuple[str, ...]
    rows: Tuple[int, ...]
    minibatches: Tuple[Tuple[int, int], ...]

    @classmethod
    def of(cls, trajs: Sequence[Trajectory], groups: Sequence[Sequence[int]], teachers: Sequence[str] = (),
           ) -> "BatchIndex":
        """The index of a whole batch, every row this rank's own (one replica)."""
        if teachers and len(teachers) != len(trajs):
            raise ValueError(f"{len(teachers)} teacher names for {len(trajs)} trajectories")
        return cls(tuple(tuple(g) for g in groups), tuple(t.sample_index for t in trajs),
                   tuple(float(t.reward) for t in trajs), tuple(token_count(t.loss_mask) for t in trajs),
                   tuple(float(t.advantage_scale) for t in trajs), tuple(teachers),
                   tuple(range(len(trajs))), ((0, len(trajs)),) if trajs else ())

    def __len__(self) -> int:
        return len(self.sample_index)

    def share(self, mini_batches: int, dp: int, rank: int) -> "BatchIndex":
        """The same index with replica ``rank``'s rows as its own."""
        rows, local = replica_rows(len(self), mini_batches, dp, rank)
        return BatchIndex(self.groups, self.sample_index, self.rewards, self.trained_tokens, self.advantage_scale,
                          self.teachers, tuple(rows), tuple(local))

    @property
    def whole(self) -> bool:
        """Whether this rank holds every row (one data-parallel replica)."""
        return len(self.rows) == len(self)


def index_groups(groups: Sequence[Sequence[Trajectory]], teachers: Optional[Sequence[str]] = None,
                 ) -> Tuple[List[Trajectory], BatchIndex]:
    """The groups' trajectories in one list and the index of that batch; ``teachers``: each
    group's teacher name (distillation from several teachers), repeated per trajectory."""
    trajs: List[Trajectory] = []
    members: List[Tuple[int, ...]] = []
    for grp in groups:
        members.append(tuple(range(len(trajs), len(trajs) + len(grp))))
        trajs.extend(grp)
    if teachers is not None and len(teachers) != len(groups):
        raise ValueError(f"{len(teachers)} teacher names for {len(groups)} groups")
    per_trajectory = tuple(name for name, grp in zip(teachers or (), groups) for _ in grp)
    return trajs, BatchIndex.of(trajs, members, per_trajectory)
