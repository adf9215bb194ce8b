"""A LoRA learner's adapters alone, as full tensors under full-model Megatron names: what a PEFT
export writes, a few MB where the merged weights are the whole model."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

from .reshard import full_tensors


def all_adapter_tensors(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every full adapter tensor (``decoder.layers.3.self_attention.linear_qkv.lora_b``) on every
    learner rank: gathered over TP per stage, then exchanged over the pipeline group. Collective
    over the learner ranks when they are initialised; one process needs no process group."""
    own = {k: v.cpu() for k, v in full_tensors(module, adapters_only=True)}
    if not dist.is_initialized():
        return own
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return own
    stages: List[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, own, group=ps.get_pipeline_model_parallel_group())
    return {k: v for stage in stages for k, v in stage.items()}
