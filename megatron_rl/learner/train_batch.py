"""One training step's batch: the scored trajectories, frozen, and what the learner derives from
them, each quantity under one name and written once.

Rollout and scoring produce ``Trajectory`` objects; from the moment a step's batch is built they
do not change (``Trajectory.freeze``). Everything computed for the update (the rewards it trains
on, advantages, proximal and reference logprobs, a critic's values and returns) is a field of
``TrainBatch``, added by ``with_fields``, which returns a new batch and refuses a field that is
already there: one writer per quantity, and a step's inputs can be read in one place.

``TrainBatch`` is a sequence of its trajectories (``len``, iteration, ``batch[i]``); a slice is the
sub-batch with the same fields, which is how data-parallel shares, mini-batches and micro-batches
cut it. A batch is either the whole step's (every rank holds it; passes over it split and
gather over the data-parallel replicas) or a replica's share (``local``: the rows the driver
sent this rank, learner/shares.py); either way ``index`` tells what every rank knows of every
row of the step (rewards, groups, trained tokens), which is all group-relative advantages need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union, overload

from ..types import Trajectory
from .shares import BatchIndex, index_groups

# Per response token, one sequence of floats per trajectory.
TOKEN_FIELDS = ("advantages", "proximal_logprobs", "ref_logprobs", "values", "returns")
# One float per trajectory.
SEQUENCE_FIELDS = ("rewards",)


@dataclass(frozen=True)
class TrainBatch(Sequence[Trajectory]):
    trajectories: Tuple[Trajectory, ...]
    # Each group's trajectory indices (group-relative advantages need them).
    groups: Tuple[Tuple[int, ...], ...] = ()
    fields: Mapping[str, tuple] = field(default_factory=dict)
    # On-policy distillation with several teachers: each trajectory's teacher (a teacher.paths
    # name, from its prompt row); empty with one teacher or none.
    teachers: Tuple[str, ...] = ()
    # What every rank knows of every row of the step (None on a slice: mini- and micro-batches).
    index: Optional[BatchIndex] = None
    # Whether the trajectories are this data-parallel replica's share (index.rows), not the whole batch.
    local: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))

    def __reduce__(self):  # pickles (to other ranks) and copies as its parts
        return TrainBatch, (self.trajectories, self.groups, dict(self.fields), self.teachers, self.index, self.local)

    @classmethod
    def of_groups(cls, groups: Sequence[Sequence[Trajectory]],
                  teachers: Optional[Sequence[str]] = None) -> "TrainBatch":
        """The batch of these groups' trajectories, frozen from now on (with Python lists as token
        fields); ``teachers``: each group's teacher name (distillation from several teachers)."""
        trajs, index = index_groups(groups, teachers)
        return cls(tuple(t.listed().freeze() for t in trajs), index.groups, teachers=index.teachers, index=index)

    @classmethod
    def share(cls, trajs: Sequence[Trajectory], index: BatchIndex) -> "TrainBatch":
        """A replica's share of the step's batch: ``trajs`` are the rows ``index.rows`` (in that
        order), frozen from now on."""
        if len(trajs) != len(index.rows):
            raise ValueError(f"{len(trajs)} trajectories for a share of {len(index.rows)} rows")
        position = {row: i for i, row in enumerate(index.rows)}
        groups = tuple(g for g in (tuple(position[r] for r in grp if r in position) for grp in index.groups) if g)
        teachers = tuple(index.teachers[r] for r in index.rows) if index.teachers else ()
        return cls(tuple(t.listed().freeze() for t in trajs), groups, teachers=teachers, index=index, local=True)

    @classmethod
    def of(cls, trajs: Sequence[Trajectory], **fields: Sequence) -> "TrainBatch":
        """One group of ``trajs`` with the given fields (tests, forward-only passes)."""
        return cls.of_groups([trajs]).with_fields(**fields) if fields else cls.of_groups([trajs])

    def with_fields(self, **new: Sequence) -> "TrainBatch":
        """A new batch with these fields added (one value per trajectory: a float for a
        sequence field, a sequence of floats per response token for a token field)."""
        for name, values in new.items():
            if name not in TOKEN_FIELDS + SEQUENCE_FIELDS:
                raise KeyError(f"unknown batch field {name!r}; fields: {TOKEN_FIELDS + SEQUENCE_FIELDS}")
            if name in self.fields:
                raise ValueError(f"the batch already has {name!r}: each quantity is written once")
            if len(values) != len(self.trajectories):
                raise ValueError(f"{name}: {len(values)} values for {len(self.trajectories)} trajectories")
        converted = {name: tuple(float(v) for v in values) if name in SEQUENCE_FIELDS
                     else tuple(self._token_row(name, i, row) for i, row in enumerate(values))
                     for name, values in new.items()}
        return TrainBatch(self.trajectories, self.groups, {**self.fields, **converted}, self.teachers, self.index,
                          self.local)

    def _token_row(self, name: str, i: int, row: Sequence[float]) -> Tuple[float, ...]:
        traj = self.trajectories[i]
        if len(row) != len(traj.response_ids):
            raise ValueError(f"trajectory {traj.prompt_uid}/{traj.sample_index}: {name} has {len(row)} values for "
                             f"{len(traj.response_ids)} response tokens")
        return tuple(float(v) for v in row)

    def has(self, name: str) -> bool:
        return name in self.fields

    def get(self, name: str) -> tuple:
        """A field's values, one per trajectory (KeyError naming the field when it is missing)."""
        try:
            return self.fields[name]
        except KeyError:
            raise KeyError(f"the batch has no {name!r} yet (has: {sorted(self.fields) or 'nothing'})") from None

    def token_values(self, i: int) -> Dict[str, Sequence[float]]:
        """Per response token of trajectory ``i``, what a micro-batch carries (see batch.py)."""
        return token_values(self, i)

    # ---------------------------------------------------------------- a sequence of trajectories
    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    @overload
    def __getitem__(self, index: int) -> Trajectory: ...

    @overload
    def __getitem__(self, index: slice) -> "TrainBatch": ...

    def __getitem__(self, index: Union[int, slice]):
        if not isinstance(index, slice):
            return self.trajectories[index]
        start, stop, step = index.indices(len(self.trajectories))
        if step != 1:
            raise ValueError("a TrainBatch slices into contiguous sub-batches only")
        kept = {name: values[start:stop] for name, values in self.fields.items()}
        groups = tuple(tuple(i - start for i in grp if start <= i < stop) for grp in self.groups)
        return TrainBatch(self.trajectories[start:stop], tuple(g for g in groups if g), kept,
                          self.teachers[start:stop], None, self.local)


def token_values(samples: Sequence[Trajectory], i: int) -> Dict[str, Sequence[float]]:
    """What a micro-batch carries per response token of sample ``i`` of a TrainBatch or of plain
    trajectories (a forward-only pass: zeros for what is not computed yet)."""
    traj = samples[i]
    n = len(traj.response_ids)
    fields: Mapping[str, tuple] = samples.fields if isinstance(samples, TrainBatch) else {}

    def token_field(name: str, default: Optional[Sequence[float]] = None) -> Sequence[float]:
        return fields[name][i] if name in fields else (default if default is not None else (0.0,) * n)

    return {
        "loss_mask": [float(m) for m in traj.loss_mask],
        "advantages": token_field("advantages"),
        "behav_logprobs": traj.logprobs,
        # Before the proximal pass (or when the training forward is the proximal pass), the
        # engine's logprobs stand in.
        "proximal_logprobs": token_field("proximal_logprobs", traj.logprobs),
        "ref_logprobs": token_field("ref_logprobs"),
        "values": token_field("values"),
        "returns": token_field("returns"),
        "versions": traj.versions,
    }


def padded(trajs: Sequence[Trajectory], rows: Sequence[Sequence[float]]) -> "torch.Tensor":
    """[len(trajs), longest response] float64 rows of a per-response-token field, right padded
    with zeros."""
    import torch

    width = max((len(t.response_ids) for t in trajs), default=0)
    out = torch.zeros(len(trajs), width, dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return out
