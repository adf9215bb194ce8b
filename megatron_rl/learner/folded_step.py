"""The optimizer step with the gradient's two scalings folded into fused Adam's own unscale.

Losses are token sums, and megatron-core turns them into a token mean by multiplying every
gradient by 1 / (global token count) once the backward is done (``finalize_model_grads``); the
gradient clip then multiplies every gradient again by max_norm / norm when the norm is above
max_norm. Each is a read and a write of the fp32 gradient buffers: for a 2.8 B-parameter MoE on an
H200, ~5 ms each, beside ~18 ms for Adam itself. torch's fused Adam divides each gradient by a
``grad_scale`` tensor as it reads it (the hook torch's GradScaler uses), so here the data-parallel
wrapper keeps the token factor instead of applying it (``ScalarScaledDDP.defer_scale``), the
gradient norm is computed once on the unscaled gradients and multiplied by the factor, and Adam
divides by 1 / (factor · clip coefficient): the same update with two passes fewer.

The norm is the non-finite check as well: an inf or NaN gradient anywhere (on any rank: the norm
is all-reduced over the model-parallel and data-parallel groups) makes it non-finite, and the
step is skipped before Adam runs, where ``megatron_step.nonfinite_cause`` scanned the buffers
separately.

Taken only when every torch optimizer under the Megatron optimizer is torch's fused Adam/AdamW
(``megatron_step.use_fused_adam``; TransformerEngine's or apex's FusedAdam have no such hook) and
there is no fp16 loss scaling.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from .adam_kernel import step_with_copy


def torch_fused_adams(optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers under a Megatron optimizer (chained or not) if every one is a fused
    torch Adam/AdamW; else [] (the step cannot be folded)."""
    inners = []
    for megatron_opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if getattr(megatron_opt, "is_stub_optimizer", False):
            continue
        inner = getattr(megatron_opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            return []
        if not all(group.get("fused") for group in inner.param_groups):
            return []
        if getattr(megatron_opt, "grad_scaler", None) is not None and megatron_opt.config.fp16:
            return []  # fp16's dynamic loss scale has its own inf check and unscale
        inners.append(inner)
    return inners


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What the gradients are multiplied by to clip them to ``max_norm`` (megatron-core's rule:
    max_norm / (norm + 1e-6) when that is below 1; no clip when ``max_norm`` is 0)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1.0e-6))


def folded_step(optimizer, grad_factor: float) -> Tuple[Optional[str], Optional[float]]:
    """One step of a Megatron optimizer whose gradients still lack the factor ``grad_factor``
    (1 / token count): (why it was skipped or None, the gradient norm of the scaled gradients).
    Skipped, the weights and the optimizer state stay as they were."""
    inners = torch_fused_adams(optimizer)
    if not inners:
        raise ValueError("folded_step needs torch's fused Adam under every Megatron optimizer")
    if optimizer.prepare_grads():
        return "non-finite gradients (fp16 loss scaling)", None
    norm = float(optimizer.get_grad_norm()) * grad_factor
    if not math.isfinite(norm):
        return "the gradient norm is not finite", None
    max_norm = (getattr(optimizer, "chained_optimizers", None) or [optimizer])[0].config.clip_grad
    multiplier = grad_factor * clip_coefficient(norm, max_norm)
    device = inners[0].param_groups[0]["params"][0].device
    scale = torch.tensor(1.0 / multiplier, dtype=torch.float32, device=device)
    for inner in inners:
        inner.grad_scale = scale  # read by torch.optim.Adam.step's fused path: grad / grad_scale
    try:
        for megatron_opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            # On a GPU, Adam and the copy into the bf16 weights as one pass (learner/adam_kernel.py).
            if not step_with_copy(megatron_opt, scale):
                megatron_opt.step_with_ready_grads()
    finally:
        for inner in inners:
            del inner.grad_scale
    return None, norm
