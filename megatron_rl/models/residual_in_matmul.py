"""The rollout engine adds each residual in the matmul before it instead of in a kernel of its own.

A transformer layer adds its input back after attention's output projection and after the MLP's
down projection (megatron-core's bias-dropout-add). At a decode step each add is a kernel of its
own over the [rows, hidden] activations: 56 of them per step in a 28-layer model, ~0.1 ms of an
H200's 4 ms step at 256 rows, launch-bound rather than bandwidth-bound. A matmul can add a tensor
in its epilogue for free (cuBLAS's beta · C), so here the projection takes the residual and the
layer's add is skipped. The matmul writes into the residual itself (``residual.addmm_(x, w.T)``):
out of place, torch's addmm copies C into its new result before the matmul, a copy per half-layer
(two per layer of a decode step). The residual is read by nothing after its half's add,
the layer's next half starting from the sum, so overwriting it is safe.

How the pieces meet without touching megatron-core's layer forward: a pre-hook on the norm that
starts each half of the layer (``input_layernorm``, ``pre_mlp_layernorm``) keeps that half's
residual, which is exactly the norm's input; the projection (``linear_proj``, ``linear_fc2``)
uses it in its matmul and marks it used; the half's bias-dropout-add then returns the projection's
output (plus its bias, if any) without adding the residual again.

Only where that is exact: forwards without autograd (the engine's; a training forward runs
megatron-core's functions unchanged), a layer not in training mode (no dropout), and a
projection that is megatron-core's RowParallelLinear on one tensor-parallel rank (with more, the
output is all-reduced after the matmul and each rank would add the residual). The sum is the
same up to rounding: the residual is added in the matmul's fp32 accumulator, then rounded once.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch


class _Residual:
    """One half-layer's residual, from its norm's pre-hook to its projection to its add."""

    def __init__(self) -> None:
        self.pending: Optional[torch.Tensor] = None
        self.used = False

    def keep(self, module: torch.nn.Module, args: tuple) -> None:
        self.used = False
        self.pending = None if torch.is_grad_enabled() or module.training else args[0]

    def matmul(self, default: Callable, input: torch.Tensor, weight: torch.Tensor, bias=None, **kwargs) -> torch.Tensor:
        residual, self.pending = self.pending, None
        fits = (residual is not None and bias is None and not torch.is_grad_enabled()
                and residual.shape == (*input.shape[:-1], weight.size(0)) and residual.dtype == input.dtype)
        if not fits:
            return default(input=input, weight=weight, bias=bias, **kwargs)
        self.used = True
        out = residual.reshape(-1, weight.size(0)).addmm_(input.reshape(-1, input.size(-1)), weight.t())
        return out.view(residual.shape)

    def bias_dropout_add(self, default: Callable, training: bool, fused: bool) -> Callable:
        add = default(training, fused)

        def run(x_with_bias, residual, prob):
            if not self.used:
                return add(x_with_bias, residual, prob)
            self.used = False
            out, bias = x_with_bias
            return out if bias is None else out + bias

        return run


def residual_in_matmul_without_grad(model: torch.nn.Module) -> int:
    """Fold each layer's residual adds into its projections' matmuls (see the module's text);
    returns how many half-layers were changed (0 where none qualifies, e.g. tensor parallelism
    or TransformerEngine's fused layers)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.utils import get_pg_size

    changed = 0
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        halves = ((layer.input_layernorm, getattr(layer.self_attention, "linear_proj", None), "self_attn_bda"),
                  (layer.pre_mlp_layernorm, getattr(layer.mlp, "linear_fc2", None), "mlp_bda"))
        for norm, projection, bda in halves:
            if not isinstance(projection, RowParallelLinear) or get_pg_size(projection.tp_group) != 1:
                continue
            if projection.explicit_expert_comm or projection.sequence_parallel:
                continue
            residual = _Residual()
            norm.register_forward_pre_hook(residual.keep)
            projection._forward_impl = functools.partial(residual.matmul, projection._forward_impl)
            setattr(layer, bda, functools.partial(residual.bias_dropout_add, getattr(layer, bda)))
            changed += 1
    return changed
