"""Stream a sharded learner's weights, as full Hugging Face tensors, to rollout engines on other
ranks: bucketed broadcasts, one weight-sync link per pipeline stage.

A stage's link joins its source rank (TP rank 0, DP rank 0 of the stage) to the receivers: the
engine ranks of the torchrun world over a group of the world (``build_sync_groups``), or vLLM's
worker processes over a channel of their own (``build_channel_groups``, ``channel.py``). The wire
format is ``buckets.py``'s, the tensors ``export.py``'s. Every learner rank takes part in
gathering the full tensors (all-gathers over the TP group, and over the EP group for routed
experts; other data-parallel replicas repeat the gathers in their own groups, which costs time
but no traffic to the engines).
Stages gather in parallel; engines receive them one after another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config.schema import ModelConfig
from .buckets import DEFAULT_BUCKET_BYTES, Link, SyncStats, WorldLink, receive_all, send_stage
from .export import stage_hf_tensors

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BUCKET_BYTES", "SyncStats", "SyncTopology", "SyncGroups", "build_sync_groups",
           "build_channel_groups", "send_weights", "send_stage_tensors", "receive_weights", "sync_topology"]


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
    # This rank's link of each stage (None: not a member of that stage's link).
    links: List[Optional[Link]] = field(default_factory=list)
    # Receive into host memory: the receiving process hands the tensors on and computes nothing
    # with them on its GPU (a vLLM engine rank, whose GPU is vLLM's).
    host_memory: bool = False


def sync_topology(num_learner_ranks: int, tp: int, pp: int, cp: int, engine_ranks: Sequence[int]) -> SyncTopology:
    """Sources under Megatron's default rank order (tp fastest, then cp, ep/dp, pp slowest): the
    first rank of each pipeline stage's block is TP rank 0 of replica 0."""
    per_stage = num_learner_ranks // pp
    return SyncTopology(tuple(stage * per_stage for stage in range(pp)), tuple(engine_ranks))


def build_sync_groups(topology: SyncTopology, timeout=None, host_memory: bool = False) -> SyncGroups:
    """Collective over the whole world (every rank calls it, members or not). ``timeout``: a
    broadcast that waits longer for a peer fails instead of hanging. ``host_memory``: gloo groups
    whose receivers take the tensors into host memory (``SyncGroups.host_memory``)."""
    from ..process_groups import new_groups

    groups = new_groups(topology.group_ranks(), backend="gloo" if host_memory else None, timeout=timeout)
    return SyncGroups(topology, [None if g is None else WorldLink(g, src) for g, src in zip(groups, topology.sources)],
                      host_memory=host_memory)


def build_channel_groups(topology: SyncTopology, host: str, receivers: int, backend: str,
                         timeout_s: float) -> Tuple[SyncGroups, List[Any]]:
    """Learner side of links to processes outside the world (vLLM's workers): each stage's
    source hosts a channel for ``receivers`` members. Returns this rank's groups and the
    addresses of the channels it hosts (to hand to the engines; empty on other ranks)."""
    from .channel import ChannelHost

    me = dist.get_rank()
    links: List[Optional[Link]] = []
    addresses = []
    for stage, src in enumerate(topology.sources):
        if src == me:
            host_ = ChannelHost(host, receivers, backend, name=f"weights-stage{stage}", timeout_s=timeout_s)
            links.append(host_.channel())
            addresses.append((stage, host_.address))
        else:
            links.append(None)
    return SyncGroups(topology, links), addresses


def _device() -> Optional[torch.device]:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def send_weights(module: torch.nn.Module, model_cfg: ModelConfig, groups: SyncGroups, version: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[SyncStats]:
    """Learner side; every learner rank calls it. Returns the stage source's statistics (None on
    ranks that only helped gather)."""
    return send_stage_tensors(stage_hf_tensors(module, model_cfg), groups, version, bucket_bytes)


def send_stage_tensors(named: Iterable[Tuple[str, torch.Tensor]], groups: SyncGroups, version: int,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[SyncStats]:
    """Learner side of any export of this stage (``named``: collective over the TP/EP groups);
    every learner rank calls it. Returns the stage source's statistics (None elsewhere)."""
    from megatron.core import parallel_state as ps

    # Every learner rank walks its tensors: the TP and EP all-gathers inside need all members, and
    # an EP group spans dense data-parallel replicas. Only each stage's source sends.
    stage = ps.get_pipeline_model_parallel_rank()
    is_source = dist.get_rank() == groups.topology.sources[stage]
    link = groups.links[stage] if is_source else None
    return send_stage(link, named, version, bucket_bytes)


def receive_weights(groups: SyncGroups) -> Tuple[int, Dict[str, torch.Tensor], SyncStats]:
    """Engine side: every stage's tensors (HF names), the version they carry, and timing."""
    return receive_all(groups.links, None if groups.host_memory else _device())
