"""Load an HF checkpoint straight into a model built at any TP/PP/EP layout (``model.path`` with a
multi-rank learner). Each rank reads only the HF tensors its own parameters come from, builds the
full Megatron tensor (hf_names) and keeps its slice:

- PP: a rank's layer i is global layer ``layer.layer_number - 1`` (Megatron numbers layers globally);
- EP: its local expert j is global expert ``mlp.local_expert_indices[j]``;
- TP: a parameter marked ``tensor_model_parallel`` is cut into equal chunks along its
  ``partition_dim``; the fused gate/up projection is cut per half (each rank holds
  ``[gate_r; up_r]``, as Megatron's SwiGLU sharding does); fused QKV rows are grouped per query
  group, so contiguous chunks are whole groups. Expert weights use the expert-TP rank.
"""

from __future__ import annotations

import re
from typing import Dict

import torch

from ..config.schema import ModelConfig
from .hf_checkpoint import ConversionError, HFTensorReader, full_state
from .hf_names import hf_sources, to_megatron

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def global_names(model: torch.nn.Module) -> Dict[str, str]:
    """Local state-dict name -> the name the same tensor has in a whole (TP=PP=EP=1) model."""
    layers = model.decoder.layers
    out = {}
    for name in full_state(model):
        global_name = name
        match = _LAYER.match(name)
        if match:
            layer = layers[int(match.group(1))]
            global_name = _LAYER.sub(f"decoder.layers.{layer.layer_number - 1}.", global_name, count=1)
            experts = getattr(layer.mlp, "local_expert_indices", None)
            expert = _EXPERT.search(name)
            if expert and experts is not None:
                global_name = _EXPERT.sub(f".local_experts.{experts[int(expert.group(1))]}.", global_name, count=1)
        out[name] = global_name
    return out


def _tp_slice(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # gated MLP: [gate; up] -> [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


@torch.no_grad()
def load_hf_weights_sharded(model: torch.nn.Module, reader: HFTensorReader, cfg: ModelConfig) -> None:
    """Fill this rank's part of a model built at any layout from an HF checkpoint."""
    from megatron.core import parallel_state as ps

    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    state = full_state(model)
    for local, name in global_names(model).items():
        if name.endswith("_extra_state"):
            continue
        # A tied output layer exists as its own parameter only on a later pipeline stage than the
        # embedding; it holds the embedding's values.
        sources = (["model.embed_tokens.weight"] if name == "output_layer.weight" and cfg.tie_word_embeddings
                   else hf_sources(name, cfg))
        for src in sources:
            if src not in reader:
                raise ConversionError(f"tensor {src!r} (needed for Megatron {name!r}) is missing from {reader.path}")
        full = to_megatron(name, [reader.get(s) for s in sources], cfg)
        param = state[local]
        rank, size = etp if ".mlp.experts." in name else tp
        part = _tp_slice(name, full, param, rank, size)
        if part.shape != param.shape:
            raise ConversionError(f"Megatron {name!r} (from {', '.join(sources)}): this rank's slice has shape "
                                  f"{tuple(part.shape)}, the model expects {tuple(param.shape)}")
        if part.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConversionError(f"tensor {sources[0]!r} has dtype {str(part.dtype).replace('torch.', '')}: "
                                  "expected float32, bfloat16 or float16")
        param.copy_(part.to(param.dtype))
