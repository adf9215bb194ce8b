"""Stream a sharded learner's weights, as full Hugging Face tensors, to rollout engines on other
ranks: bucketed broadcasts over weight-sync groups.

There is one weight-sync group per pipeline stage: ``[that stage's source rank] + engine ranks``,
where the source is the stage's rank with TP rank 0 and DP rank 0. A send is, per stage and in
stage order, a run of buckets; each bucket is a header (version, names, shapes, dtypes, byte
offsets) broadcast as an object, then one flat byte buffer broadcast as a tensor; an empty header
ends the stage. Every learner rank takes part in gathering the full tensors (all-gathers over
the TP group, and over the EP group for routed experts; other data-parallel replicas repeat the
gathers in their own groups, which costs time but no traffic to the engines).
Stages gather in parallel; engines receive them one after another. Buckets bound the memory a
send needs beyond the model (one bucket of gathered tensors on the source, one on each engine as
it arrives) and let the transfer overlap the gathering of the next tensors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config.schema import ModelConfig
from ..models.hf_names import megatron_to_hf
from .reshard import full_tensors

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class SyncStats:
    version: int
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


@dataclass(frozen=True)
class SyncTopology:
    """Global ranks of the weight-sync groups: ``sources[s]`` sends stage s to every engine rank."""
    sources: Tuple[int, ...]
    engine_ranks: Tuple[int, ...]

    def group_ranks(self) -> List[List[int]]:
        return [[src, *self.engine_ranks] for src in self.sources]


@dataclass
class SyncGroups:
    topology: SyncTopology
    groups: List[Optional[dist.ProcessGroup]] = field(default_factory=list)  # None: not a member


def sync_topology(num_learner_ranks: int, tp: int, pp: int, cp: int, engine_ranks: Sequence[int]) -> SyncTopology:
    """Sources under Megatron's default rank order (tp fastest, then cp, ep/dp, pp slowest): the
    first rank of each pipeline stage's block is TP rank 0 of replica 0."""
    per_stage = num_learner_ranks // pp
    return SyncTopology(tuple(stage * per_stage for stage in range(pp)), tuple(engine_ranks))


def build_sync_groups(topology: SyncTopology, timeout=None) -> SyncGroups:
    """Collective over the whole world (every rank calls it, members or not). ``timeout``: a
    broadcast that waits longer for a peer fails instead of hanging."""
    from ..launch.groups import new_groups

    return SyncGroups(topology, new_groups(topology.group_ranks(), timeout=timeout))


def _device() -> Optional[torch.device]:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _hf_tensors(module: torch.nn.Module, model_cfg: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, full in full_tensors(module):
        yield from megatron_to_hf(name, full, model_cfg)


def all_hf_tensors(module: torch.nn.Module, model_cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Every full HF-named tensor of the model on every learner rank (colocated engines load from
    their own rank): TP/EP-gathered per stage, then exchanged over the pipeline group. Collective
    over the learner ranks. Objects over the pipeline group are pickled: fine on CPU; on GPU,
    colocated engines should take CUDA IPC handles instead (not implemented)."""
    from megatron.core import parallel_state as ps

    own = dict(_hf_tensors(module, model_cfg))
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return own
    stages: List[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, {k: v.cpu() for k, v in own.items()}, group=ps.get_pipeline_model_parallel_group())
    return {k: v for stage in stages for k, v in stage.items()}


def _buckets(named: Iterator[Tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    bucket: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def send_weights(module: torch.nn.Module, model_cfg: ModelConfig, groups: SyncGroups, version: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[SyncStats]:
    """Learner side; every learner rank calls it. Returns the stage source's statistics (None on
    ranks that only helped gather)."""
    from megatron.core import parallel_state as ps

    # Every learner rank walks its tensors: the TP and EP all-gathers inside need all members, and
    # an EP group spans dense data-parallel replicas. Only each stage's source sends.
    stage = ps.get_pipeline_model_parallel_rank()
    src = groups.topology.sources[stage]
    is_source = dist.get_rank() == src
    group = groups.groups[stage] if is_source else None
    stats = SyncStats(version)
    start = time.perf_counter()
    for bucket in _buckets(_hf_tensors(module, model_cfg), bucket_bytes):
        if not is_source:
            continue  # helped with the TP all-gathers inside the iterator
        header, flat = _pack(bucket, version)
        dist.broadcast_object_list([header], src=src, group=group)
        dist.broadcast(flat, src=src, group=group)
        stats.bytes += flat.numel()
        stats.tensors += len(bucket)
        stats.buckets += 1
    if not is_source:
        return None
    dist.broadcast_object_list([None], src=src, group=group)  # end of this stage
    stats.seconds = time.perf_counter() - start
    return stats


def receive_weights(groups: SyncGroups) -> Tuple[int, Dict[str, torch.Tensor], SyncStats]:
    """Engine side: every stage's tensors (HF names), the version they carry, and timing."""
    out: Dict[str, torch.Tensor] = {}
    version = -1
    stats = SyncStats(version)
    start = time.perf_counter()
    for src, group in zip(groups.topology.sources, groups.groups):
        while True:
            box: List[Any] = [None]
            dist.broadcast_object_list(box, src=src, group=group)
            header = box[0]
            if header is None:
                break
            version = header["version"]
            flat = torch.empty(header["nbytes"], dtype=torch.uint8, device=_device())
            dist.broadcast(flat, src=src, group=group)
            out.update(_unpack(header, flat))
            stats.bytes += flat.numel()
            stats.tensors += len(header["names"])
            stats.buckets += 1
    stats.version = version
    stats.seconds = time.perf_counter() - start
    return version, out, stats


def _pack(bucket: List[Tuple[str, torch.Tensor]], version: int) -> Tuple[Dict[str, Any], torch.Tensor]:
    # Bytes, not values: one buffer carries any mix of dtypes bit for bit.
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    header = {
        "version": version,
        "names": [n for n, _ in bucket],
        "shapes": [tuple(t.shape) for _, t in bucket],
        "dtypes": [t.dtype for _, t in bucket],
        "nbytes": flat.numel(),
    }
    return header, flat


def _unpack(header: Dict[str, Any], flat: torch.Tensor) -> Dict[str, torch.Tensor]:
    out = {}
    offset = 0
    for name, shape, dtype in zip(header["names"], header["shapes"], header["dtypes"]):
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        # Cloned before the view: a slice at an odd byte offset cannot be viewed as a wider dtype.
        out[name] = flat[offset : offset + n].clone().view(dtype).reshape(shape)
        offset += n
    return out
