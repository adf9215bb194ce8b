"""A LoRA learner's weights split as the adapter-only paths need them: the adapters alone, as full
tensors under full-model Megatron names (``decoder.layers.3.self_attention.linear_qkv.lora_b``, a
few MB where the merged weights are the whole model), and the frozen base unmerged under HF names."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from ..config.schema import ModelConfig
from ..models.hf_names import megatron_to_hf
from ..models.lora import is_adapter_name
from .reshard import full_tensors


def all_adapter_tensors(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every full adapter tensor on every learner rank, on the CPU: gathered over TP per stage,
    then exchanged over the pipeline group. Collective over the learner ranks."""
    own = {k: v.cpu() for k, v in full_tensors(module, adapters_only=True)}
    if not dist.is_initialized():
        return own
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return own
    stages: List[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, own, group=ps.get_pipeline_model_parallel_group())
    return {k: v for stage in stages for k, v in stage.items()}


def base_hf_tensors(module: torch.nn.Module, model_cfg: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's frozen base as full tensors under HF names, unmerged (the adapters left out).
    Collective over the tensor-parallel group."""
    for name, tensor in full_tensors(module):
        if not is_adapter_name(name):
            yield from megatron_to_hf(name, tensor, model_cfg)
