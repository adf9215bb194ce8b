"""The critic of PPO: the policy's Megatron GPTModel with its vocabulary projection replaced by a
scalar value head, so the critic runs with the same parallel layout (TP/PP/EP) and the same
pipeline schedules as the policy.

The head is a replicated [1, hidden] projection: under tensor parallelism the hidden states
after the final norm are already whole on every TP rank, so each rank computes the same values
and the same head gradient (no reduction needed, like the norm weights)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ..config.schema import ModelConfig
from .gpt import build_gpt_model, cuda_available
from .lora import export_state


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: [s, b, h] hidden states -> ([s, b, 1] values, None).
    Zero-initialised, so the untrained critic predicts 0 everywhere (GAE then starts as
    Monte-Carlo returns) instead of noise."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        # GPTModel reads these from its output layer.
        self.sequence_parallel = False

    def forward(self, hidden_states: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> Tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def build_value_model(cfg: ModelConfig, vocab_size: int, tp: int = 1, pp: int = 1, ep: int = 1,
                      policy: Optional[torch.nn.Module] = None):
    """A GPTModel whose forward returns values [b, s, 1]. With ``policy`` (a GPTModel of the same
    layout), every trunk weight is copied from it: the critic starts from the policy's features,
    as PPO-RLHF critics start from the SFT model."""
    # The head replaces the output layer, so there is nothing to tie the embedding to.
    model = build_gpt_model(dataclasses.replace(cfg, tie_word_embeddings=False), vocab_size, tp=tp, pp=pp, ep=ep)
    if model.post_process:
        dtype = next(model.parameters()).dtype
        head = ValueHead(model.config.hidden_size, dtype)
        if cuda_available():
            head = head.cuda(torch.cuda.current_device())
        model.output_layer = head
    if policy is not None:
        # A LoRA policy's weights merged (the critic has no adapters; it trains all its weights).
        trunk = {k: v.detach() for k, v in export_state(policy, merge=True) if not k.startswith("output_layer.")}
        missing, unexpected = model.load_state_dict(trunk, strict=False)
        missing = [k for k in missing if not k.startswith("output_layer.") and not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"critic and policy layouts differ: missing {missing}, unexpected {unexpected}")
    return model
