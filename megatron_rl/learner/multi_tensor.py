"""Multi-tensor kernels for megatron-core's optimizer when neither TransformerEngine nor apex is
installed, on torch's ``_foreach`` ops.

megatron-core takes its gradient-norm and scale kernels (``multi_tensor_l2norm``,
``multi_tensor_scale``) from TransformerEngine or apex; without them it falls back to a loop that
computes each tensor's norm, then builds a host tensor of those norms (one device-to-host wait per
parameter: 1,056 waits and ~44 ms per step for a 4-layer, 128-expert model on an H200), and
copies or scales tensor by tensor (the fp32 → bf16 copy-back after every step). torch's
``_foreach`` ops do the same arithmetic over the whole list in a few fused launches and never
wait for the host. Installed only where megatron-core runs its own fallback, so TransformerEngine
or apex stay in charge where they are present.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)


def foreach_applier(op, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]], *args):
    """megatron-core's ``multi_tensor_applier`` signature: ``op(chunk_size, noop_flag, lists, *args)``."""
    return op(2048 * 32, noop_flag, tensor_lists, *args)


def foreach_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],
                   per_tensor: bool, *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(l2 norm of all tensors of ``tensor_lists[0]`` together as one fp32 [1] tensor on their
    device, per-tensor norms if ``per_tensor``): the norm of the per-tensor norms, as
    megatron-core's fallback computes it, with no wait for the host."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    stacked = torch.stack([n.to(tensors[0].device) for n in norms])
    total = torch.linalg.vector_norm(stacked).reshape(1)
    return total, (stacked if per_tensor else None)


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],
                  scale: float) -> None:
    """``dst = src * scale`` for the pairs of ``tensor_lists`` (src, dst): a fused copy for a
    scale of 1 (megatron-core's copy of fp32 main weights into bf16 model weights), an in-place
    fused multiply when every destination is its source (gradient clipping); otherwise pair by
    pair, as megatron-core's fallback."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        for s, d in zip(src, dst):
            d.copy_(s * scale)


def use_foreach_kernels() -> int:
    """Point megatron-core's optimizer modules at the ``_foreach`` kernels wherever they hold its
    own local fallbacks; returns how many module attributes changed (0 with TransformerEngine or
    apex, or when already done)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    replacements = {
        utils.local_multi_tensor_applier: foreach_applier,
        utils.local_multi_tensor_l2_norm: foreach_l2norm,
        utils.local_multi_tensor_scale: foreach_scale,
    }
    changed = 0
    for module in (clip_grads, optimizer):
        for name in ("multi_tensor_applier", "l2_norm_impl", "multi_tensor_scale_impl"):
            current = getattr(module, name, None)
            if current in replacements:
                setattr(module, name, replacements[current])
                changed += 1
    if changed:
        logger.debug("megatron-core optimizer: torch _foreach kernels for norm and scale (%d hooks)", changed)
    return changed


def use_foreach_copies(optimizer) -> int:
    """Let megatron-core's bf16 optimizers copy between fp32 main weights and bf16 model weights
    through ``multi_tensor_scale`` (one fused ``_foreach_copy_``) rather than tensor by tensor:
    they skip it in bf16 because apex's kernel has no bf16 version, which ``foreach_scale`` does
    not lack. Only where megatron-core's optimizer module uses ``foreach_scale``; returns how many
    optimizers changed."""
    from megatron.core.optimizer import optimizer as optimizer_module

    if optimizer_module.multi_tensor_scale_impl is not foreach_scale:
        return 0
    changed = 0
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(inner, "_dummy_overflow_buf") and inner._dummy_overflow_buf is None:
            device = next((p.device for g in inner.param_groups for p in g["params"]), torch.device("cpu"))
            inner._dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=device)
            changed += 1
    return changed
