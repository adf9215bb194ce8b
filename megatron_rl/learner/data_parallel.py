"""How one batch is shared out over the learner's parallel ranks, and how results come back.

A rank holds either the whole batch (then each data-parallel replica takes a contiguous slice,
all TP/PP ranks of one replica the same) or its replica's share only (``local``: the driver sent
it those rows, learner/shares.py, and nothing is sliced or gathered). Within a replica only the last
pipeline stage sees logits, so per-token results and loss statistics are broadcast from it to
the other stages, then gathered (logprobs) or summed (token sums) over the replicas. The loss
itself needs no help: it is a token sum and Megatron divides the all-reduced gradients by the
global token count, so any split of the batch gives the same update as one rank with all of it.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from .shares import dp_bounds

T = TypeVar("T")


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def dp_size_rank() -> Tuple[int, int]:
    ps = _ps()
    return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()


class LocalRows(list):
    """Rows that are this replica's share already (a pass over them is not split or gathered)."""

    local = True


def is_local(items: Sequence) -> bool:
    """Whether ``items`` is this replica's share (LocalRows, or a TrainBatch of a share)."""
    return bool(getattr(items, "local", False))


def local_share(items: Sequence[T]) -> Sequence[T]:
    """This data-parallel replica's slice of the batch (a TrainBatch slices into one); a share
    already is its own slice."""
    if is_local(items):
        return items
    dp, rank = dp_size_rank()
    if len(items) < dp:
        # Every replica must run the step's collectives (gradient all-reduce, optimizer).
        raise ValueError(f"a batch of {len(items)} sequences cannot be split over {dp} data-parallel "
                         f"replicas: give each at least one (more groups per batch or fewer replicas)")
    start, end = dp_bounds(len(items), dp, rank)
    return items[start:end]


def from_last_stage(obj: T) -> T:
    """``obj`` as the last pipeline stage of this replica has it (a picklable value)."""
    ps = _ps()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    src = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
    return box[0]


def gather_shares(local: List[T]) -> List[T]:
    """Concatenate every replica's list in replica order (the inverse of ``local_share``)."""
    ps = _ps()
    if ps.get_data_parallel_world_size() == 1:
        return local
    parts: List[List[T]] = [None] * ps.get_data_parallel_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, local, group=ps.get_data_parallel_group())
    return [x for part in parts for x in part]


def gather_rows(rows: Sequence[int], values: Sequence[T], n: int) -> List[T]:
    """All ``n`` rows' values, on every rank, from each replica's ``values`` of its global
    ``rows`` (one small object per row crosses the data-parallel group)."""
    ps = _ps()
    out: List = [None] * n
    parts = [(list(rows), list(values))]
    if ps.get_data_parallel_world_size() > 1:
        parts = [None] * ps.get_data_parallel_world_size()  # type: ignore[list-item]
        dist.all_gather_object(parts, (list(rows), list(values)), group=ps.get_data_parallel_group())
    for part_rows, part_values in parts:
        for i, value in zip(part_rows, part_values):
            out[i] = value
    return out


def sum_over_replicas(stats: Dict[str, float]) -> Dict[str, float]:
    """Sum token-sum statistics over the data-parallel replicas (keys equal on every rank)."""
    ps = _ps()
    if ps.get_data_parallel_world_size() == 1 or not stats:
        return stats
    keys = sorted(stats)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    values = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, group=ps.get_data_parallel_group())
    return dict(zip(keys, values.tolist()))


def sum_over_stages_and_replicas(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the pipeline stages and data-parallel replicas (each rank counting its
    own layers and share of the batch); tensor-parallel ranks count the same and are not added."""
    ps = _ps()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    values = values.to(device)
    for size, group in ((ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group()),
                        (ps.get_data_parallel_world_size(), ps.get_data_parallel_group())):
        if size > 1:
            dist.all_reduce(values, group=group)
    return values.cpu()


def uniform_micro_batches(trajs: Sequence, token_budget: int, pad_id: int) -> List:
    """Micro-batches of one shape and count on every data-parallel replica.

    Needed when replicas meet inside the forward: an MoE layer under expert parallelism
    exchanges tokens with the other EP ranks (all-gathers of equal-shaped routing data, then
    all-to-alls) once per micro-batch, so every replica must run as many micro-batches of the
    same [rows, seq_len]. Replicas with fewer sequences get filler rows (zero loss mask), which
    change no loss or gradient (with a load-balancing loss they would count as routed tokens)."""
    from .batch import _collate

    ps = _ps()
    longest = max((len(t.prompt_ids) + len(t.response_ids) for t in trajs), default=1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    sizes = torch.tensor([longest, len(trajs)], dtype=torch.long, device=device)
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    seq_len, most = (int(v) for v in sizes.tolist())
    rows = max(1, token_budget // seq_len)
    batches = []
    for start in range(0, max(most, 1), rows):
        idx = list(range(start, min(start + rows, len(trajs))))
        batches.append(_collate(trajs, idx, rows, seq_len, pad_id))
    return batches
