"""Between one rank's shard of a Megatron GPTModel and the full (TP=PP=EP=1) tensors.

A learner rank holds, for its pipeline stage, the layers ``offset .. offset + n - 1`` under local
names ``decoder.layers.0 ..``, and of each tensor-parallel weight the slice its TP rank owns
(``param.partition_dim`` says along which dimension; Megatron sets it on every TP-split
parameter). Two layouts need more than a concatenation:
- the gated MLP's ``linear_fc1`` holds ``[gate_r; up_r]`` on TP rank r, so the full ``[gate; up]``
  is the gates of every rank followed by the ups (a plain concatenation would interleave them);
- the fused QKV is grouped by KV head and each TP rank holds whole groups, so concatenating the
  shards in rank order *is* the full layout.
Routed experts (MoE, SequentialMLP) are split over the expert-parallel group (each rank holds
``num_experts / ep`` whole experts, numbered locally from 0) and their linears over the expert-TP
group, which Megatron sizes separately from the dense TP group.

``full_tensors`` (gather; collective over the TP group) and ``load_full_tensors`` (scatter; local)
are exact inverses; both speak full Megatron names with global layer numbers, which
``models.hf_names`` maps to Hugging Face names.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, Mapping, Tuple

import torch
import torch.distributed as dist

from ..models.lora import export_state, is_adapter_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# A routed expert's weights (SequentialMLP): ``local_experts.<j>`` is expert ep_rank * n_local + j.
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def layer_offset(module: torch.nn.Module) -> int:
    """Global number of this pipeline stage's first layer."""
    layers = getattr(getattr(module, "decoder", None), "layers", None)
    if not layers:
        return 0
    return int(layers[0].layer_number) - 1  # Megatron numbers layers from 1, globally


def to_global_name(name: str, offset: int) -> str:
    match = _LAYER.match(name)
    if not match or not offset:
        return name
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"


def to_local_name(name: str, offset: int, num_local_layers: int) -> str | None:
    """The local name of a full-model tensor on this stage, or None if another stage holds it."""
    match = _LAYER.match(name)
    if not match:
        return name
    local = int(match.group(1)) - offset
    if not 0 <= local < num_local_layers:
        return None
    return f"decoder.layers.{local}.{match.group(2)}"


def _is_gated_fc1(name: str, module: torch.nn.Module) -> bool:
    """A gated MLP's fused gate/up weight, or its LoRA B (whose rows follow the weight's)."""
    config = getattr(module, "config", None)
    return bool(getattr(config, "gated_linear_unit", False)) and name.endswith(("linear_fc1.weight",
                                                                                   "linear_fc1.lora_b"))


def _tp_dim(param: torch.Tensor) -> int | None:
    if getattr(param, "tensor_model_parallel", False):
        return int(getattr(param, "partition_dim", 0))
    return None


def _weights(module: torch.nn.Module, merged: bool = False, adapters_only: bool = False,
             ) -> Iterator[Tuple[str, torch.Tensor, int | None]]:
    """(local name, tensor, TP partition dim or None) for every weight in the state dict.
    ``merged``: LoRA-adapted weights merged and the adapters left out (models/lora.py);
    ``adapters_only``: the LoRA adapters alone."""
    params = dict(module.named_parameters())
    for name, tensor in export_state(module, merge=merged):
        if name.endswith("_extra_state") or (adapters_only and not is_adapter_name(name)):
            continue  # TransformerEngine keeps FP8 metadata there: no weights
        source = params.get(name, tensor)
        yield name, tensor, _tp_dim(source)


@torch.no_grad()
def full_tensors(module: torch.nn.Module, merged: bool = False, adapters_only: bool = False,
                 copy: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """This pipeline stage's tensors, gathered over the TP group, under global Megatron names.
    ``merged``: under LoRA, each adapted weight merged with its adapter and the adapters left out
    (what engines load); ``adapters_only``: the LoRA adapters alone. Neither: every tensor as
    stored (the inverse of ``load_full_tensors``). ``copy`` False: a tensor this rank holds whole
    is yielded as is, not cloned (for a consumer that sends or copies it before the next update).

    Collective over the tensor-parallel group: every TP rank of the stage must iterate it to the
    end in step (each yields the same full tensors)."""
    offset = layer_offset(module)
    ep, ep_rank, n_local = _expert_split(module)
    for name, tensor, dim in _weights(module, merged, adapters_only):
        expert = _EXPERT.match(name)
        tp, tp_rank, group = _tp_of(bool(expert)) if dim is not None else (1, 0, None)
        local = tensor.detach()
        if dim is None or tp == 1:
            full = local.clone() if copy else local
        else:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=group)
            if _is_gated_fc1(name, module):
                halves = [torch.chunk(s, 2, dim=0) for s in shards]
                full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                full = torch.cat(shards, dim=dim)
        if expert is None:
            yield to_global_name(name, offset), full
            continue
        prefix, j, suffix = expert.group(1), int(expert.group(2)), expert.group(3)
        parts = [full]
        if ep > 1:  # local expert j of every EP rank
            parts = [torch.empty_like(full) for _ in range(ep)]
            dist.all_gather(parts, full.contiguous(), group=_parallel_state().get_expert_model_parallel_group())
        for r, part in enumerate(parts):
            yield to_global_name(f"{prefix}{r * n_local + j}{suffix}", offset), part


def _tp_of(expert: bool):
    """(size, rank, group) of the tensor-parallel group that splits a dense or an expert weight."""
    ps = _parallel_state()
    if expert:
        size = ps.get_expert_tensor_parallel_world_size()
        return size, ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_group() if size > 1 else None
    size = ps.get_tensor_model_parallel_world_size()
    return size, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group() if size > 1 else None


def _expert_split(module: torch.nn.Module):
    """(ep size, ep rank, experts per rank); (1, 0, 0) for a dense model."""
    experts = getattr(getattr(module, "config", None), "num_moe_experts", None)
    if not experts:
        return 1, 0, 0
    ps = _parallel_state()
    ep = ps.get_expert_model_parallel_world_size()
    return ep, ps.get_expert_model_parallel_rank(), experts // ep


@torch.no_grad()
def load_full_tensors(module: torch.nn.Module, full: Mapping[str, torch.Tensor], strict: bool = True) -> int:
    """Copy this rank's slice of each full tensor into ``module``; returns how many were set.

    ``strict``: every local weight must be present in ``full`` (a partial load is an error)."""
    offset = layer_offset(module)
    ep, ep_rank, n_local = _expert_split(module)
    loaded = 0
    for name, tensor, dim in _weights(module):
        expert = _EXPERT.match(name)
        tp, rank, _ = _tp_of(bool(expert))
        if expert is not None:
            name = f"{expert.group(1)}{ep_rank * n_local + int(expert.group(2))}{expert.group(3)}"
        key = to_global_name(name, offset)
        if key not in full:
            if strict:
                raise KeyError(f"no full tensor for {key!r} (local {name!r})")
            continue
        src = full[key]
        if dim is not None and tp > 1:
            if _is_gated_fc1(name, module):
                gate, up = torch.chunk(src, 2, dim=0)
                src = torch.cat([torch.chunk(gate, tp, 0)[rank], torch.chunk(up, tp, 0)[rank]], dim=0)
            else:
                src = torch.chunk(src, tp, dim=dim)[rank]
        if tuple(src.shape) != tuple(tensor.shape):
            raise ValueError(f"{key}: local shard {tuple(tensor.shape)} != slice of full tensor {tuple(src.shape)}")
        tensor.data.copy_(src.to(tensor.dtype))
        loaded += 1
    return loaded


def full_state(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """All of this stage's full tensors in a dict (collective over the TP group)."""
    return dict(full_tensors(module))


def load_into_learner(learner, full: Mapping[str, torch.Tensor]) -> None:
    """Set a (possibly sharded) learner's weights from full Megatron-named tensors, optimizer's
    master copies included (bf16 training keeps fp32 copies that would otherwise keep the old
    values)."""
    load_full_tensors(learner.module, full)
    learner.optimizer.reload_model_params()
