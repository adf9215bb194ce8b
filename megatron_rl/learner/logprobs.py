"""Per-token logprobs and entropy from (possibly vocabulary-sharded) logits.

Under tensor parallelism each rank holds logits for a slice of the vocabulary; the reductions
below all-reduce over the TP group so every rank gets the full-vocabulary answer.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] for logits [..., V_local] and integer targets [...]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # The division makes a fresh fp32 tensor, which the kernel may modify in place.
    scaled = logits.float() / temperature
    return -vocab_parallel_cross_entropy(scaled, targets)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the full (TP-sharded) vocabulary, differentiable."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    scaled = logits.float() / temperature
    local_max = scaled.max(dim=-1, keepdim=True).values.detach()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(local_max, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
    shifted = scaled - local_max
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    return sum_exp.log() - weighted / sum_exp
