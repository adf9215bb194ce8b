"""The LM head writes its logits straight into a buffer the caller owns (the engine's decode graphs).

Every captured decode step (one CUDA graph per batch and width bucket) must leave its logits in
one shared buffer: a graph's own output tensor would be a [rows, V] allocation per graph (dozens
of graphs, 78 MB each at 256 rows of a 152k vocabulary). Copying the head's output into the buffer
costs a kernel that reads and writes those 78 MB, ~40 us of a 4 ms step on an H200. Here, while a
target is set, the head's matmul is ``torch.mm(..., out=target)``: the same cuBLAS product, written
where the caller reads it, and the copy is gone.

Only where that is exact: no autograd, no bias, one tensor-parallel rank (megatron-core's
ColumnParallelLinear gathers nothing then), and a target of the output's shape and dtype; anything
else runs megatron-core's own function and the caller copies as before.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional

import torch


class LogitsTarget:
    """Where the LM head writes while ``writing_to`` is active."""

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self.writes = 0  # forwards whose logits went straight into a buffer

    @contextlib.contextmanager
    def writing_to(self, buffer: torch.Tensor) -> Iterator[None]:
        """The head's forwards inside write their [tokens, V] logits into ``buffer``'s first rows."""
        self.buffer = buffer
        try:
            yield
        finally:
            self.buffer = None

    def matmul(self, default: Callable, input: torch.Tensor, weight: torch.Tensor, bias=None, **kwargs) -> torch.Tensor:
        target = self.buffer
        tokens = input.numel() // input.size(-1)
        fits = (target is not None and bias is None and not torch.is_grad_enabled() and target.dim() == 2
                and target.size(0) >= tokens and target.size(1) == weight.size(0) and target.dtype == input.dtype
                and target.is_contiguous())
        if not fits:
            return default(input=input, weight=weight, bias=bias, **kwargs)
        out = target[:tokens]
        torch.mm(input.reshape(tokens, input.size(-1)), weight.t(), out=out)
        self.writes += 1
        return out.view(*input.shape[:-1], weight.size(0))


def logits_target(model: torch.nn.Module) -> Optional[LogitsTarget]:
    """The LM head's target of ``model`` (installed on first use); None where the head is not
    megatron-core's ColumnParallelLinear on one tensor-parallel rank without a bias."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.utils import get_pg_size

    head = getattr(getattr(model, "module", model), "output_layer", None)
    if not isinstance(head, ColumnParallelLinear) or head.bias is not None or get_pg_size(head.tp_group) != 1:
        return None
    if head.sequence_parallel or head.explicit_expert_comm:
        return None
    target = getattr(head, "_logits_target", None)
    if target is None:
        target = head._logits_target = LogitsTarget()
        head._forward_impl = functools.partial(target.matmul, head._forward_impl)
    return target
