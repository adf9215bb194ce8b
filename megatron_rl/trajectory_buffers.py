"""Trajectories as flat buffers: how they cross processes (the data plane).

A list of trajectories becomes one contiguous byte buffer: per token field one flat array of
every row's values end to end (prompt and response ids, behaviour logprobs, policy versions,
loss masks, recorded expert choices), per row its lengths, and a small header with each row's
scalar metadata (ids, reward, finish reason, ...). Packing and unpacking cost a copy per token
field, not a Python object per token as pickling lists does, and a receiver can be handed
exactly the rows it needs. ``pack(rows).to_bytes()`` and ``TrajectoryBuffers.from_bytes`` are
inverse, and ``unpack`` gives back trajectories equal to the packed ones (logprobs are stored
in float32 only when that loses nothing).
"""

from __future__ import annotations

import operator
import pickle
import struct
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from .types import GenerationChunk, Trajectory

# Token fields in the order they are laid out; each is one flat array over all rows.
_ID_FIELDS = ("prompt_ids", "response_ids")
_RESPONSE_FIELDS = ("logprobs", "versions", "loss_mask")
_SCALARS = ("prompt_uid", "sample_index", "finish_reason", "reward", "reward_info", "advantage_scale", "agent_run")
_HEADER = struct.Struct("<Q")  # the header's length, then the header, then the arrays
_scalars_of = operator.attrgetter(*_SCALARS)


def _logprob_dtype(values: np.ndarray) -> np.dtype:
    """float32 when every logprob is a float32 value already (engines compute them so), else
    float64: the wire never rounds a number it carries."""
    f32 = values.astype(np.float32)
    return np.dtype(np.float32) if np.array_equal(f32.astype(np.float64), values, equal_nan=True) else np.dtype(np.float64)


@dataclass(frozen=True)
class TrajectoryBuffers:
    """Rows of trajectories as flat arrays. ``lengths[name]`` holds each row's length of the
    token field ``name``; ``arrays[name]`` the values end to end; ``scalars`` per row the
    metadata that is not per token; ``experts_shape``: the trailing [moe_layers, top_k] of the
    recorded expert choices (rows without any have length 0 there)."""

    lengths: Dict[str, np.ndarray]
    arrays: Dict[str, np.ndarray]
    scalars: List[Tuple[Any, ...]]
    experts_shape: Tuple[int, ...] = ()
    has_experts: Tuple[bool, ...] = ()

    def __len__(self) -> int:
        return len(self.scalars)

    @property
    def tokens(self) -> int:
        """Prompt plus response tokens of every row."""
        return int(self.lengths["prompt_ids"].sum() + self.lengths["response_ids"].sum())

    # ------------------------------------------------------------------ bytes
    def to_bytes(self) -> np.ndarray:
        """One uint8 array: the header's length, the header (pickled metadata: a few numbers
        per row), then each array's raw bytes."""
        names = list(self.arrays)
        header = pickle.dumps({
            "lengths": self.lengths, "scalars": self.scalars, "experts_shape": self.experts_shape,
            "has_experts": self.has_experts,
            "arrays": [(name, self.arrays[name].dtype.str, self.arrays[name].shape) for name in names],
        }, protocol=pickle.HIGHEST_PROTOCOL)
        total = _HEADER.size + len(header) + sum(self.arrays[name].nbytes for name in names)
        out = np.empty(total, dtype=np.uint8)
        out[: _HEADER.size] = np.frombuffer(_HEADER.pack(len(header)), dtype=np.uint8)
        at = _HEADER.size + len(header)
        out[_HEADER.size: at] = np.frombuffer(header, dtype=np.uint8)
        for name in names:
            raw = np.ascontiguousarray(self.arrays[name]).reshape(-1).view(np.uint8)
            out[at: at + raw.size] = raw
            at += raw.size
        return out

    @classmethod
    def from_bytes(cls, data: np.ndarray) -> "TrajectoryBuffers":
        """The buffers ``to_bytes`` wrote (the arrays are views into ``data``, not copies)."""
        data = np.asarray(data, dtype=np.uint8).reshape(-1)
        (size,), at = _HEADER.unpack(data[: _HEADER.size].tobytes()), _HEADER.size
        header = pickle.loads(data[at: at + size].tobytes())
        at += size
        arrays = {}
        for name, dtype, shape in header["arrays"]:
            dtype = np.dtype(dtype)
            count = int(np.prod(shape)) if shape else 1
            arrays[name] = data[at: at + count * dtype.itemsize].view(dtype).reshape(shape)
            at += count * dtype.itemsize
        return cls(header["lengths"], arrays, header["scalars"], tuple(header["experts_shape"]),
                   tuple(header["has_experts"]))

    # ------------------------------------------------------------------ rows
    def select(self, rows: Sequence[int]) -> "TrajectoryBuffers":
        """The buffers of these rows only, in this order."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths, arrays = {}, {}
        for name, lens in self.lengths.items():
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if len(lens) else np.zeros(0, dtype=np.int64)
            picked = [self.arrays[name][starts[i]: starts[i] + lens[i]] for i in rows]
            lengths[name] = lens[rows]
            arrays[name] = (np.concatenate(picked) if picked else self.arrays[name][:0])
        return replace(self, lengths=lengths, arrays=arrays, scalars=[self.scalars[i] for i in rows],
                       has_experts=tuple(self.has_experts[i] for i in rows))


def pack(trajs: Sequence[Trajectory]) -> TrajectoryBuffers:
    """The flat buffers of ``trajs`` (see the module's docstring), views into ``pack_bytes``'s."""
    return TrajectoryBuffers.from_bytes(pack_bytes(trajs))


def pack_bytes(trajs: Sequence[Trajectory]) -> np.ndarray:
    """``pack(trajs).to_bytes()`` with one copy of each token: every field is concatenated
    straight into its place in the one buffer."""
    rows: Dict[str, List[Any]] = {name: [getattr(t, name) for t in trajs] for name in _ID_FIELDS + _RESPONSE_FIELDS}
    lengths = {name: np.fromiter(map(len, rows[name]), dtype=np.int64, count=len(trajs))
               for name in _ID_FIELDS}
    for name in _RESPONSE_FIELDS:
        lengths[name] = lengths["response_ids"]
    dtypes = {"prompt_ids": np.dtype(np.int32), "response_ids": np.dtype(np.int32),
              "logprobs": _logprobs_dtype(rows["logprobs"]), "versions": np.dtype(np.int32),
              "loss_mask": np.dtype(np.uint8)}
    recorded = tuple(t.routed_experts is not None for t in trajs)
    experts_shape: Tuple[int, ...] = ()
    if any(recorded):
        first = np.asarray(next(t.routed_experts for t in trajs if t.routed_experts is not None))
        experts_shape = tuple(first.shape[1:])
        per_position = int(np.prod(experts_shape))
        rows["routed_experts"] = [np.asarray(t.routed_experts).reshape(-1) if t.routed_experts is not None
                                  else np.zeros(0, dtype=first.dtype) for t in trajs]
        lengths["routed_experts"] = np.fromiter(map(len, rows["routed_experts"]), dtype=np.int64, count=len(trajs))
        assert not (lengths["routed_experts"] % max(per_position, 1)).any()
        dtypes["routed_experts"] = first.dtype
    names = list(dtypes)
    shapes = {name: (int(lengths[name].sum()),) for name in names}
    header = pickle.dumps({
        "lengths": lengths, "scalars": list(map(_scalars_of, trajs)), "experts_shape": experts_shape,
        "has_experts": recorded, "arrays": [(name, dtypes[name].str, shapes[name]) for name in names],
    }, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = [shapes[name][0] * dtypes[name].itemsize for name in names]
    out = np.empty(_HEADER.size + len(header) + sum(sizes), dtype=np.uint8)
    out[: _HEADER.size] = np.frombuffer(_HEADER.pack(len(header)), dtype=np.uint8)
    at = _HEADER.size + len(header)
    out[_HEADER.size: at] = np.frombuffer(header, dtype=np.uint8)
    for name, size in zip(names, sizes):
        target = out[at: at + size].view(dtypes[name])
        if rows[name] and size:
            np.concatenate(rows[name], out=target, casting="unsafe")  # lists are converted on the way
        at += size
    return out


def _logprobs_dtype(rows: Sequence[Any]) -> np.dtype:
    """float32 when every row's logprobs are float32 values (engines' arrays are; lists are
    checked), else float64: the wire never rounds a number it carries."""
    if all(isinstance(r, np.ndarray) and r.dtype == np.float32 for r in rows):
        return np.dtype(np.float32)
    values = np.concatenate(rows, dtype=np.float64) if rows else np.zeros(0)
    return _logprob_dtype(values)


def unpack(buffers: TrajectoryBuffers) -> List[Trajectory]:
    """The trajectories of ``buffers``, with plain Python lists as token fields."""
    split: Dict[str, List[np.ndarray]] = {}
    for name, lens in buffers.lengths.items():
        split[name] = np.split(buffers.arrays[name], np.cumsum(lens)[:-1]) if len(lens) else []
    out = []
    for i, scalar in enumerate(buffers.scalars):
        meta = dict(zip(_SCALARS, scalar))
        experts = None
        if buffers.has_experts and buffers.has_experts[i]:
            experts = split["routed_experts"][i].reshape((-1,) + buffers.experts_shape).copy()
        out.append(Trajectory(
            meta["prompt_uid"], meta["sample_index"], split["prompt_ids"][i].tolist(),
            split["response_ids"][i].tolist(), split["logprobs"][i].astype(np.float64).tolist(),
            split["versions"][i].tolist(), meta["finish_reason"], loss_mask=split["loss_mask"][i].tolist(),
            reward=meta["reward"], reward_info=meta["reward_info"], advantage_scale=meta["advantage_scale"],
            agent_run=meta["agent_run"], routed_experts=experts))
    return out


def response_arrays(response: GenerationChunk) -> GenerationChunk:
    """A whole response with numpy arrays as token fields: how an engine behind a connection
    sends a group's answers (a buffer per field pickles at memory speed, a list per token does
    not; the driver never turns them into an object per token)."""
    logprobs = np.asarray(response.logprobs, dtype=np.float64)
    return replace(response, token_ids=np.asarray(response.token_ids, dtype=np.int32),
                   logprobs=logprobs.astype(_logprob_dtype(logprobs), copy=False),
                   versions=np.asarray(response.versions, dtype=np.int32))
