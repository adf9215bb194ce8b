"""The one export of a learner's weights: its TP/PP/EP shards as full tensors under Hugging Face
names, in the layout every engine loads (LoRA adapters merged into their weights).

Every path that takes weights out of a learner uses it: the in-process and colocated pushes, the
broadcast to engine ranks and vLLM's workers (one stage at a time, ``stage_hf_tensors``), the
Hugging Face directory a checkpoint exports, and ``Learner.export_hf_weights``.

``all_hf_tensors`` gives every stage's tensors to every learner rank (colocated engines load
from their own rank): each stage's tensors go round the pipeline group as flat bucket tensors
(``buckets.py``'s wire format over ``dist.broadcast``: NCCL on GPUs, the tensors stay on the
device; gloo on CPUs), not as pickled CPU copies.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from ..config.schema import ModelConfig
from ..models.hf_names import megatron_to_hf
from .buckets import DEFAULT_BUCKET_BYTES, SyncStats, WorldLink, receive_stages, send_stage
from .reshard import full_tensors

__all__ = ["stage_hf_tensors", "all_hf_tensors", "all_stage_tensors"]

NamedTensors = Iterator[Tuple[str, torch.Tensor]]


def stage_hf_tensors(module: torch.nn.Module, model_cfg: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """This pipeline stage's full tensors under HF names (every stage's at PP = 1). Collective
    over the TP and EP groups: every rank of the stage iterates it to the end, in step."""
    # LoRA adapters merged into their weights: engines load plain HF tensors. A tensor that a
    # rank holds whole is handed out as is (no copy): consumers copy or send it right away.
    for name, full in full_tensors(module, merged=True, copy=False):
        yield from megatron_to_hf(name, full, model_cfg)


def all_hf_tensors(module: torch.nn.Module, model_cfg: ModelConfig,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every stage's full HF tensors on every learner rank, stage by stage. At PP = 1 (one
    process included) they stream straight from the gather; otherwise each stage's rank of the
    pipeline group broadcasts its tensors in buckets to the others, stages in order. Collective
    over the learner ranks: each must iterate it to the end."""
    return all_stage_tensors(module, lambda: stage_hf_tensors(module, model_cfg), bucket_bytes)


def all_stage_tensors(module: torch.nn.Module, stage_tensors: Callable[[], NamedTensors],
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> NamedTensors:
    """Every stage's ``stage_tensors()`` on every learner rank, stage by stage (``all_hf_tensors``
    with another export of a stage, e.g. a LoRA learner's frozen base and adapters unmerged).
    ``stage_tensors`` is collective over the TP/EP groups; this, over the learner ranks."""
    pp_group = _pipeline_group()
    if pp_group is None:
        yield from stage_tensors()
        return
    from megatron.core import parallel_state as ps

    mine = ps.get_pipeline_model_parallel_rank()
    for stage in range(dist.get_world_size(pp_group)):
        link = WorldLink(pp_group, dist.get_global_rank(pp_group, stage))
        if stage == mine:
            # Sent from the gather as it goes; what this rank hands out is its own tensors.
            own = list(stage_tensors())
            send_stage(link, own, version=-1, bucket_bytes=bucket_bytes)
            yield from own
        else:
            yield from receive_stages([link], _device_of(module), SyncStats(-1))


def _pipeline_group() -> Optional[dist.ProcessGroup]:
    """The pipeline group when there is more than one stage, else None."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_pipeline_model_parallel_group()


def _device_of(module: torch.nn.Module) -> Optional[torch.device]:
    param = next(module.parameters(), None)
    return None if param is None else param.device
