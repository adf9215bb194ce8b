"""AdamW's update and the copy into the bf16 model weights as one Triton kernel per large tensor (GPU).

megatron-core's bf16 optimizer keeps fp32 main weights. Each step torch's fused AdamW reads a main
weight, its gradient and both moments and writes the weight and the moments (28 bytes per
parameter); then a second pass reads the fp32 weights again and writes the bf16 model weights (6
more). For a 3.1 B-parameter MoE on an H200 the two took 29.9 + 5.2 ms, ~71 % of what their bytes
need at the card's 4.3 TB/s. ``step_with_copy`` does both in one pass (30 bytes per parameter) for
every tensor of at least ``MIN_ELEMENTS``; the small ones (norms, routers, biases: many tensors, few
bytes) stay with torch's fused AdamW and one foreach copy, which batch them into a few launches,
where a launch per tensor would cost more host time than the GPU saves.

The arithmetic is torch's fused AdamW's on the same device: fp32 elements with correctly rounded
square roots and divisions (Triton's defaults are approximate), the bias corrections from each
tensor's own step count (incremented here as torch does), decoupled weight decay, the gradient
divided by ``grad_scale`` (learner/folded_step.py puts the token mean and the clip there). The bias
corrections are float64 on either device; torch's two kernels differ in the rest, and each is
followed where it runs: on a GPU the hyperparameters are rounded to fp32 (1 - fp32(0.999) is
1.3e-5 off 0.001) and the decay and moments are fused multiply-adds, on a CPU they are plain
fp32 products from float64 coefficients. The optimizer state stays torch's (the same tensors), so
checkpoints and ``load_state_dict`` see no difference.

Before its first use on a device the kernel is run once beside torch's fused AdamW on a small
tensor (``agrees_with_torch``); if they differ, a warning says by how much and torch's step is
kept, so a triton or GPU the tests never ran on cannot silently train wrong weights.

Used when triton imports and the weights are on a GPU (or under Triton's interpreter); anything
else (an optimizer that is not megatron-core's bf16 one over torch's AdamW, amsgrad, state not yet
created on the first step, a tensor learning rate) steps the usual way. CI has no GPU: the kernel
runs through Triton's interpreter in the vLLM test phase (tests/test_adam_kernel.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Dict, List, Optional

import torch
from torch.optim.adam import adam as functional_adam

from ..models.decode_attention import triton_runs_on

logger = logging.getLogger(__name__)

# torch's functional Adam takes AdamW's decoupled decay (torch >= 2.6 or so); older: never fused here.
_FUNCTIONAL_ADAMW = "decoupled_weight_decay" in inspect.signature(functional_adam).parameters
# Tensors below this many elements go through torch's multi-tensor AdamW and copy.
MIN_ELEMENTS = 1 << 20
BLOCK = 4096


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernel runs for tensors like this one: on a GPU (or under Triton's
    interpreter), with triton importable."""
    return triton_runs_on(tensor)


def _applies(megatron_opt, inner: torch.optim.Optimizer) -> bool:
    if not (hasattr(megatron_opt, "float16_groups") and hasattr(megatron_opt, "fp32_from_float16_groups")):
        return False  # not megatron-core's bf16 optimizer (fp32 weights need no copy)
    if getattr(megatron_opt.config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return False
    if not (isinstance(inner, torch.optim.AdamW) and _FUNCTIONAL_ADAMW):
        return False
    for group in inner.param_groups:
        if group.get("amsgrad") or group.get("maximize") or isinstance(group["lr"], torch.Tensor):
            return False
        for p in group["params"]:
            if p.grad is None:
                continue
            state = inner.state.get(p, {})
            step = state.get("step")
            if not (isinstance(step, torch.Tensor) and step.device == p.device and "exp_avg" in state):
                return False  # first step: torch creates the state
    return True


def step_with_copy(megatron_opt, grad_scale: Optional[torch.Tensor] = None) -> bool:
    """One AdamW step of ``megatron_opt`` (megatron-core's bf16 optimizer over torch's AdamW) that
    also writes the bf16 model weights, what its ``step_with_ready_grads`` does in two passes.
    The gradients are divided by ``grad_scale`` (a device scalar) when given. Returns False, having
    done nothing, where it does not apply (the caller then steps the usual way)."""
    inner = getattr(megatron_opt, "optimizer", None)
    if inner is None or getattr(megatron_opt, "is_stub_optimizer", False) or not _applies(megatron_opt, inner):
        return False
    first = next((p for g in inner.param_groups for p in g["params"]), None)
    if first is None or not available(first) or not agrees_with_torch(first.device):
        return False
    model_of: Dict[int, torch.Tensor] = {
        id(main): model
        for models, mains in zip(megatron_opt.float16_groups, megatron_opt.fp32_from_float16_groups)
        for model, main in zip(models, mains)
    }
    small_mains: List[torch.Tensor] = []
    small_models: List[torch.Tensor] = []
    for group in inner.param_groups:
        big, small = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            model = model_of.get(id(p))
            state = inner.state[p]
            fits = (model is not None and p.numel() >= MIN_ELEMENTS and model.shape == p.shape
                    and all(t.is_contiguous() for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"], model)))
            (big if fits else small).append(p)
        _fused_kernels(big, [model_of[id(p)] for p in big], inner, group, grad_scale)
        if small:
            states = [inner.state[p] for p in small]
            functional_adam(
                small, [p.grad for p in small], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [], [s["step"] for s in states], fused=True, grad_scale=grad_scale, found_inf=None,
                decoupled_weight_decay=True, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )
            for p in small:
                if id(p) in model_of:
                    small_mains.append(p.detach())
                    small_models.append(model_of[id(p)].data)
    if small_models:
        torch._foreach_copy_(small_models, small_mains)
    return True


def _fused_kernels(mains: List[torch.Tensor], models: List[torch.Tensor], inner: torch.optim.Optimizer,
                   group: dict, grad_scale: Optional[torch.Tensor]) -> None:
    if not mains:
        return
    steps = [inner.state[p]["step"] for p in mains]
    torch._foreach_add_(steps, 1)
    beta1, beta2 = group["betas"]
    kernel = _kernel()
    scale = grad_scale if grad_scale is not None else steps[0]  # unread without HAS_SCALE
    lr, decay = float(group["lr"]), float(group["weight_decay"])
    for p, model, step in zip(mains, models, steps):
        state = inner.state[p]
        n = p.numel()
        kernel[(triton_cdiv(n, BLOCK),)](
            p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"], model.data, step, scale, n,
            lr, 1.0 - lr * decay, decay, float(beta1), 1.0 - float(beta1), float(beta2), 1.0 - float(beta2),
            math.log(beta1), math.log(beta2), float(group["eps"]),
            HAS_SCALE=grad_scale is not None, CUDA_ARITHMETIC=p.device.type == "cuda", BLOCK=BLOCK, num_warps=8,
        )


@functools.lru_cache(maxsize=None)
def agrees_with_torch(device: torch.device) -> bool:
    """Whether the kernel, compiled for ``device``, gives torch's fused AdamW on a small tensor
    (checked once per device: a safeguard for a triton or GPU the tests never ran on). If not, a
    warning names the difference and the optimizer keeps torch's step."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = 3 * BLOCK + 5  # several programs and a partial last block
    p, g, m = (torch.randn(n, generator=gen).to(device) for _ in range(3))
    v = torch.rand(n, generator=gen).to(device)
    step, scale = torch.tensor(3.0, device=device), torch.tensor(0.5, device=device)
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    expected = [t.clone() for t in (p, g, m, v)]
    torch._fused_adamw_([expected[0]], [expected[1]], [expected[2]], [expected[3]], [], [step + 1], lr=group["lr"],
                        beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
                        grad_scale=scale, found_inf=None)
    model = torch.empty(n, dtype=torch.bfloat16, device=device)

    class _State:  # the optimizer-shaped view _fused_kernels reads
        state = {}

    p.grad = g
    _State.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
    try:
        _fused_kernels([p], [model], _State, group, scale)
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile here
        logger.warning("the fused AdamW + copy kernel fails on %s (%s: %s): the optimizer keeps torch's step",
                       device, type(exc).__name__, exc)
        return False
    diffs = {name: float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))
             for name, ours, theirs in (("weight", p, expected[0]), ("exp_avg", m, expected[2]),
                                        ("exp_avg_sq", v, expected[3]))}
    # The bf16 copy: the fp32 result rounded (to nearest on a GPU; the interpreter truncates).
    copy_units = float(((model.float() - p).abs() / p.abs().clamp_min(1e-30)).max()) / 2 ** -7
    if step.item() != 4.0 or max(diffs.values()) > 1e-5 or copy_units > 1.0:
        diffs["bf16 copy, in units of 2^-7"] = copy_units
        logger.warning("the fused AdamW + copy kernel disagrees with torch's AdamW on %s (step %s, relative "
                       "differences %s): the optimizer keeps torch's step", device, step.item(), diffs)
        return False
    return True


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_copy_kernel(P, G, M, V, Out, Step, Scale, n, lr, decay_factor, weight_decay, beta1, one_minus_beta1,
                          beta2, one_minus_beta2, log_beta1, log_beta2, eps, HAS_SCALE: tl.constexpr,
                          CUDA_ARITHMETIC: tl.constexpr, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(Scale))
        p = tl.load(P + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        m = tl.load(M + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        v = tl.load(V + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        # The bias corrections in float64, as both of torch's kernels form them (1 - 0.999**step
        # cancels most digits; fp32's approximate exponential left 1e-4 of relative error in it).
        step = tl.load(Step).to(tl.float64)
        if CUDA_ARITHMETIC:
            # torch's CUDA kernel raises the fp32-rounded betas to the step in float64: the exact
            # betas' powers put one weight element in a thousand 1e-7 off it by the third step.
            bias_correction1 = 1.0 - tl.extra.libdevice.pow(beta1.to(tl.float64), step)
            bias_correction2 = 1.0 - tl.extra.libdevice.pow(beta2.to(tl.float64), step)
        else:
            bias_correction1 = 1.0 - tl.exp(step * log_beta1)
            bias_correction2 = 1.0 - tl.exp(step * log_beta2)
        step_size = (lr / bias_correction1).to(tl.float32)
        bias_correction2_sqrt = tl.sqrt(bias_correction2).to(tl.float32)
        if CUDA_ARITHMETIC:
            # torch's CUDA kernel: the hyperparameters rounded to fp32 (these arguments are), the
            # decay and the moments as fused multiply-adds.
            p = tl.fma(-(lr * weight_decay), p, p)
            m = tl.fma(beta1, m, (1.0 - beta1) * g)
            v = tl.fma(beta2, v, ((1.0 - beta2) * g) * g)
        else:
            p = p * decay_factor
            m = beta1 * m + one_minus_beta1 * g
            v = beta2 * v + one_minus_beta2 * g * g
        # Correctly rounded square root and divisions (Triton's defaults are approximate), in
        # torch's order: p - (step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps).
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(P + offs, p, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
        tl.store(Out + offs, p.to(Out.dtype.element_ty), mask=mask)

    return adamw_copy_kernel
