"""Per-token logprobs and entropy from (possibly vocabulary-sharded) logits, in chunks of tokens.

Under tensor parallelism each rank holds logits for a slice of the vocabulary; the reductions
below all-reduce over the TP group so every rank gets the full-vocabulary answer.

Why chunks: the log-softmax of a large vocabulary in fp32 is the largest tensor of a training step
(16k tokens × 151,936 entries × 4 bytes = 10 GB, and a naive forward + backward keeps several such
tensors alive). Here the logits stay in their own dtype; fp32 work runs on a few hundred tokens at a
time, and only per-token statistics (log-normaliser, entropy) are kept for the backward, which
recomputes each chunk's softmax instead of storing it. On a GPU with triton the chunks give way
to two Triton kernels (``logprob_kernels.py``): one read of the logits for the statistics, one read
and one write for the gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..compiled import CompiledOrEager
from . import logprob_kernels

# fp32 elements of one chunk's working tensors (a few of them are alive at once): 2**25 is 128 MB,
# ~220 tokens of a 152k vocabulary. On a GPU each chunk is a call of a compiled function whose
# guards and launch cost ~0.3 ms of host time, more than its kernels take at that size (16k tokens:
# 75 chunks, the GPU idle two thirds of the time), so chunks there are four times larger (512 MB).
CHUNK_ELEMENTS = 2 ** 25
CUDA_CHUNK_ELEMENTS = 2 ** 27


def _tp_group():
    """(group, rank, world size) of tensor parallelism, or (None, 0, 1) without it."""
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover - megatron is a dependency; kept for a bare import
        return None, 0, 1
    if not parallel_state.model_parallel_is_initialized():
        return None, 0, 1
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1:
        return None, 0, 1
    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank(), world


def _chunks(n: int, width: int, chunk_elements: int):
    rows = max(1, chunk_elements // max(width, 1))
    for start in range(0, n, rows):
        yield slice(start, min(start + rows, n))


def forward_chunk(logits: torch.Tensor, local_targets: torch.Tensor, in_range: torch.Tensor, temperature: float,
                  maxes: Optional[torch.Tensor]):
    """One chunk's per-token (max, sum of exp, sum of exp * shifted logit, target logit) of the
    logits / T, shifted by ``maxes`` (the TP group's) or by the chunk's own max when None."""
    scaled = logits.float() / temperature
    m = scaled.amax(dim=-1) if maxes is None else maxes
    shifted = scaled - m.unsqueeze(1)
    exp = shifted.exp()
    target = scaled.gather(1, local_targets.unsqueeze(1)).squeeze(1)
    return m, exp.sum(dim=-1), (exp * shifted).sum(dim=-1), torch.where(in_range, target, torch.zeros_like(target))


def backward_chunk(logits: torch.Tensor, local_targets: torch.Tensor, in_range: torch.Tensor, log_norm: torch.Tensor,
                   entropy: torch.Tensor, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk, in the logits' dtype.
    d logprob_t / d s_k = [k = t] - p_k;  d H / d s_k = -p_k (log p_k + H);  s = logits / T."""
    logp = logits.float() / temperature - log_norm.unsqueeze(1)
    prob = logp.exp()
    grad = -prob * (grad_entropy.unsqueeze(1) * (logp + entropy.unsqueeze(1)) + grad_logprobs.unsqueeze(1))
    vocab = torch.arange(logits.shape[1], device=logits.device)
    hit = (vocab.unsqueeze(0) == local_targets.unsqueeze(1)) & in_range.unsqueeze(1)
    grad = grad + torch.where(hit, grad_logprobs.unsqueeze(1), torch.zeros_like(grad))
    return (grad / temperature).to(logits.dtype)


# The chunk functions, compiled on a GPU: one fused pass over each chunk's logits instead of several
# element-wise kernels and fp32 temporaries.
FORWARD_CHUNK = CompiledOrEager(forward_chunk, "logprob forward kernel")
BACKWARD_CHUNK = CompiledOrEager(backward_chunk, "logprob backward kernel")


def _chunked_statistics(logits: torch.Tensor, local_targets: torch.Tensor, in_range: torch.Tensor, temperature: float,
                        chunk_elements: int, group, with_entropy: bool):
    """(log Z, logprob of the target, entropy) per row, a chunk of rows at a time (any device)."""
    n, width = logits.shape
    dev = logits.device
    maxes = torch.empty(n, dtype=torch.float32, device=dev)
    if group is not None:  # every rank shifts by the same (global) max so sums add up
        for c in _chunks(n, width, chunk_elements):
            maxes[c] = logits[c].max(dim=-1).values.float() / temperature
        torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=group)
    # sum of exp, sum of exp * shifted logit, target logit; one all-reduce for the three.
    sums = torch.zeros(3, n, dtype=torch.float32, device=dev)
    for c in _chunks(n, width, chunk_elements):
        m, sum_exp, weighted, target = FORWARD_CHUNK(logits[c], local_targets[c], in_range[c], temperature,
                                                    maxes[c] if group is not None else None)
        maxes[c], sums[0, c], sums[1, c], sums[2, c] = m, sum_exp, weighted, target
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    log_sum = sums[0].log()
    log_norm = maxes + log_sum  # log Z of softmax(logits / T)
    logprobs = sums[2] - log_norm
    entropy = log_sum - sums[1] / sums[0] if with_entropy else torch.zeros_like(log_sum)
    return log_norm, logprobs, entropy


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """(logprob of the target, entropy) per token for logits [N, V_local]; see module docstring."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_elements: int,
                with_entropy: bool):
        group, rank, _ = _tp_group()
        n, width = logits.shape
        local_targets = targets - rank * width
        in_range = (local_targets >= 0) & (local_targets < width)
        local_targets = torch.where(in_range, local_targets, torch.zeros_like(local_targets))
        ctx.kernels = logprob_kernels.available(logits)
        if ctx.kernels:  # one read of the logits on a GPU (learner/logprob_kernels.py)
            stats = logprob_kernels.row_statistics(logits, local_targets, in_range, temperature)
            if group is not None:
                stats = logprob_kernels.combine_shards(stats, group)
            log_norm, logprobs, entropy = logprob_kernels.reduce_statistics(stats)
            if not with_entropy:
                entropy = torch.zeros_like(log_norm)
        else:
            log_norm, logprobs, entropy = _chunked_statistics(logits, local_targets, in_range, temperature,
                                                              chunk_elements, group, with_entropy)
        ctx.save_for_backward(logits, local_targets, in_range, log_norm, entropy)
        ctx.temperature = temperature
        ctx.chunk_elements = chunk_elements
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        logits, local_targets, in_range, log_norm, entropy = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(log_norm)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(log_norm)
        if ctx.kernels:
            grad = logprob_kernels.logits_gradient(logits, local_targets, in_range, log_norm, entropy,
                                                   grad_logprobs.float().contiguous(),
                                                   grad_entropy.float().contiguous(), ctx.temperature)
            return grad, None, None, None, None
        n, width = logits.shape
        grad = torch.empty_like(logits)
        for c in _chunks(n, width, ctx.chunk_elements):
            grad[c] = BACKWARD_CHUNK(logits[c], local_targets[c], in_range[c], log_norm[c], entropy[c],
                                   grad_logprobs[c], grad_entropy[c], ctx.temperature)
        return grad, None, None, None, None


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                               with_entropy: bool = True,
                               chunk_elements: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(logits / T)[target], entropy of softmax(logits / T)) for logits [..., V_local]
    and integer targets [...], both fp32 of targets' shape and differentiable; full-vocabulary
    reductions under TP. Without ``with_entropy`` the entropy is not computed (zeros).
    ``chunk_elements``: fp32 elements per chunk, ``CHUNK_ELEMENTS`` (``CUDA_CHUNK_ELEMENTS`` for
    logits on a GPU; read at call time) if None."""
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    default = CUDA_CHUNK_ELEMENTS if logits.is_cuda else CHUNK_ELEMENTS
    logprobs, entropy = _ChunkedLogprobEntropy.apply(flat, targets.reshape(-1), float(temperature),
                                                     int(chunk_elements or default), bool(with_entropy))
    return logprobs.view(shape), entropy.view(shape)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_elements: Optional[int] = None) -> torch.Tensor:
    """log softmax(logits / T)[target] for logits [..., V_local] and integer targets [...]."""
    return token_logprobs_and_entropy(logits, targets, temperature, with_entropy=False,
                                      chunk_elements=chunk_elements)[0]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_elements: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the full (TP-sharded) vocabulary, differentiable."""
    targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return token_logprobs_and_entropy(logits, targets, temperature, chunk_elements=chunk_elements)[1]
