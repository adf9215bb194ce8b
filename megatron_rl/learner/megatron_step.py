"""What the policy and the critic share: a Megatron model wrapped for training (DDP + Megatron
optimizer) and one pass over micro-batches through Megatron's pipeline schedules, forward-only
or forward-backward + optimizer step. The same code runs at PP = 1 and PP > 1."""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config.schema import LearnerConfig
from ..types import Trajectory
from .batch import (MICRO_BATCH_OVERHEAD_TOKENS, MicroBatch, build_micro_batches, build_shared_micro_batches,
                    response_values)
from .data_parallel import (from_last_stage, gather_shares, is_local, local_share, sum_over_replicas,
                            uniform_micro_batches)
from .folded_step import folded_step, torch_fused_adams

logger = logging.getLogger(__name__)

# (data_iterator, model) -> (output tensor, function of the output): Megatron's forward_step_func.
StepFn = Callable


def wrap_for_training(model: torch.nn.Module, lc: LearnerConfig, bf16: bool, lr: float):
    """(DistributedDataParallel model, Megatron optimizer) for a bare GPTModel."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ..models.grouped_moe import accumulate_expert_grads_into_main_grad, stack_expert_parameters
    from .multi_tensor import use_foreach_copies, use_foreach_kernels

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=lc.use_distributed_optimizer,
    )
    # Two parameters per MoE layer's experts, not two per expert: the wrapper and the optimizer
    # below loop over parameters in Python.
    stack_expert_parameters(model)
    wrapped = _scalar_scaled_ddp_class()(config=model.config, ddp_config=ddp_config, module=model)
    # Replicas start from data-parallel rank 0's weights (experts from their expert-DP rank 0),
    # whatever each rank's random state did during the build: megatron-core initialises the MoE
    # router on the CPU generator, the rest of a GPU model on CUDA ones, and a replica that
    # starts different stays different (its updates are the same all-reduced gradient).
    wrapped.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=lc.weight_decay,
            adam_beta1=lc.adam_beta1, adam_beta2=lc.adam_beta2, adam_eps=lc.adam_eps,
            clip_grad=lc.clip_grad, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=lc.use_distributed_optimizer,
        ),
        [wrapped],
    )
    use_foreach_kernels()
    use_foreach_copies(optimizer)
    if not ddp_config.overlap_grad_reduce:  # no per-parameter hook needs to see expert gradients
        accumulate_expert_grads_into_main_grad(model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.grad_scale_func = optimizer.scale_loss
    use_fused_adam(optimizer)
    # The 1 / tokens factor and the clip go into fused Adam's unscale (learner/folded_step.py).
    wrapped.defer_scale = bool(torch_fused_adams(optimizer))
    return wrapped, optimizer


@functools.lru_cache(maxsize=None)
def _scalar_scaled_ddp_class():
    """The class below, built on first use (megatron-core is imported lazily here)."""
    from megatron.core.distributed import DistributedDataParallel

    from ..models.grouped_moe import mark_expert_grads_zeroed

    class ScalarScaledDDP(DistributedDataParallel):
        """megatron-core's data-parallel wrapper, scaling the gradient buffers by a Python float.
        ``finalize_model_grads`` passes 1 / (global token count) as a device scalar, and a buffer
        times a device scalar runs torch's broadcasting kernel (8.8 ms for the 11 GB fp32 buffer of
        a 2.8 B-parameter MoE on an H200) instead of the vectorised one. Reading the value costs no
        extra wait: finalize has just compared it with 0 on the host. Same product (the fp32 factor
        converts exactly). With ``defer_scale`` the factor is kept (``take_grad_factor``) instead of
        applied: the optimizer step folds it into Adam (learner/folded_step.py). Zeroing the
        buffers tells the grouped experts so (their first weight gradient is written, not added)."""

        defer_scale = False
        pending_factor = 1.0

        def scale_gradients(self, scaling_factor) -> None:
            if isinstance(scaling_factor, torch.Tensor):
                scaling_factor = float(scaling_factor)
            if self.defer_scale:
                self.pending_factor *= scaling_factor
                return
            super().scale_gradients(scaling_factor)

        def zero_grad_buffer(self) -> None:
            super().zero_grad_buffer()
            mark_expert_grads_zeroed(self.module)

        def take_grad_factor(self) -> float:
            """The factor the gradients still lack (1 when none was deferred); resets it."""
            factor, self.pending_factor = self.pending_factor, 1.0
            return factor

    return ScalarScaledDDP


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam/AdamW under a Megatron optimizer (the fallback without TransformerEngine
    or apex) to its fused single-kernel step (on a GPU and on a CPU): torch's default there is
    ``foreach``, a few kernels per tensor group. The update is the same, and the fused step can
    unscale the gradients as it reads them (learner/folded_step.py); returns how many torch
    optimizers were switched."""
    switched = 0
    for megatron_opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(megatron_opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue  # TransformerEngine's / apex's FusedAdam already is one kernel
        inner.defaults.update(fused=True, foreach=False)
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
        switched += 1
    return switched


def forward_only(model: torch.nn.Module, mbs: Sequence[MicroBatch], step_fn: StepFn) -> List:
    """Run ``step_fn`` over the micro-batches without gradients; the values its collect function
    returns (one per micro-batch, on the last pipeline stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=iter(mbs), model=[model], num_microbatches=len(mbs),
        seq_length=mbs[0].seq_len, micro_batch_size=mbs[0].tokens.shape[0],
        forward_only=True, collect_non_loss_data=True,
    )


def optimizer_step(model: torch.nn.Module, optimizer, mbs: Sequence[MicroBatch], step_fn: StepFn,
                   what: str = "policy") -> Tuple[Dict[str, float], float]:
    """Forward-backward over the micro-batches and one optimizer step. ``step_fn``'s loss function
    returns (loss sum, denominator, stats); stats are summed over micro-batches."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=iter(mbs), model=[model], num_microbatches=len(mbs),
        seq_length=mbs[0].seq_len, micro_batch_size=mbs[0].tokens.shape[0], forward_only=False,
    )
    stats: Dict[str, float] = {}
    for out in outputs:  # loss statistics exist on the last pipeline stage only
        for k, v in out.items():
            stats[k] = stats.get(k, 0.0) + float(v)
    stats = sum_over_replicas(from_last_stage(stats))  # the same on every learner rank
    # Megatron's optimizer finds inf/NaN gradients only under fp16 loss scaling; in bf16 and fp32
    # it would apply them, and one step of NaN gradients makes every weight NaN for good.
    if getattr(model, "defer_scale", False):
        factor = model.take_grad_factor()
        grad_norm = None
        if nonfinite_loss(stats.get("loss_sum")):  # skipped: name the gradients' state too
            cause = nonfinite_cause(model, stats.get("loss_sum"))
        else:  # the gradient norm is the gradients' non-finite check
            cause, grad_norm = folded_step(optimizer, factor)
        ok = cause is None
    else:
        cause = nonfinite_cause(model, stats.get("loss_sum"))
        ok = cause is None
        if ok:
            ok, grad_norm, _ = optimizer.step()
            cause = None if ok else "non-finite gradients (fp16 loss scaling)"
    if not ok:
        logger.warning("%s optimizer step skipped: %s; the weights stay as they were", what, cause)
        grad_norm = None
    stats["skipped_steps"] = 0.0 if ok else 1.0
    return stats, float(grad_norm) if grad_norm is not None else float("nan")


def nonfinite_cause(model: torch.nn.Module, loss_sum: Optional[float]) -> Optional[str]:
    """Why the optimizer step must not be taken: a non-finite loss or gradient on any learner
    rank (None: it may be). Every rank gets the same answer, so all of them skip together (the
    loss sum is already the same on every rank)."""
    loss_problem = nonfinite_loss(loss_sum)
    problems = [loss_problem] if loss_problem else []
    # The largest magnitude of each gradient buffer is inf or NaN exactly when some entry is:
    # one read of the buffer, where isfinite().all() writes a boolean copy of it first.
    if _on_any_rank(model, [~torch.isfinite(torch.linalg.vector_norm(g, float("inf"))) for g in _gradients(model)]):
        problems.append("the gradient norm is not finite")
    return " and ".join(problems) or None


def nonfinite_loss(loss_sum: Optional[float]) -> Optional[str]:
    """``the loss is nan`` (or inf) when the step's loss sum is not finite, else None."""
    return f"the loss is {loss_sum}" if loss_sum is not None and not math.isfinite(loss_sum) else None


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every weight on every learner rank is finite (a collective call)."""
    return not _on_any_rank(model, [~torch.isfinite(p).all() for p in model.parameters()])


def _on_any_rank(model: torch.nn.Module, local: List[torch.Tensor]) -> bool:
    """Whether any of the boolean tensors ``local`` is true on any learner rank."""
    device = next(model.parameters()).device
    flag = torch.stack(local).any().float().reshape(1) if local else torch.zeros(1, device=device)
    if torch.distributed.is_initialized():
        from megatron.core import parallel_state as ps

        # Every rank is in one model-parallel group and one data-parallel group, and these
        # groups tile the learner ranks: a flag raised anywhere reaches every rank in two steps.
        for group in (ps.get_model_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)):
            if torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return flag.item() > 0


def _gradients(model: torch.nn.Module) -> List[torch.Tensor]:
    """The gradient tensors of a DDP-wrapped model: its contiguous gradient buffers (one check
    each), else each parameter's gradient."""
    # Megatron's DDP keeps lists here (a plain Module's ``buffers`` is a method).
    buffers = [b for name in ("buffers", "expert_parallel_buffers")
               if isinstance(getattr(model, name, None), list) for b in getattr(model, name)]
    if buffers and all(hasattr(b, "grad_data") for b in buffers):
        return [b.grad_data for b in buffers]
    grads = (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in model.parameters())
    return [g for g in grads if g is not None]


def finite_mean(values: Sequence[float]) -> float:
    """Mean of the finite values (a skipped step's gradient norm is NaN); NaN when none is."""
    finite = [v for v in values if math.isfinite(v)]
    return float(sum(finite) / len(finite)) if finite else float("nan")


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def micro_batches(trajs: Sequence[Trajectory], lc: LearnerConfig, pad_id: int) -> List[MicroBatch]:
    if lc.ep > 1:  # MoE layers exchange tokens between replicas per micro-batch
        return uniform_micro_batches(trajs, lc.micro_batch_tokens, pad_id)
    # Pipeline schedules exchange one activation shape; without a pipeline, pack by length.
    overhead = lc.micro_batch_overhead_tokens
    if overhead is None:
        overhead = MICRO_BATCH_OVERHEAD_TOKENS["cuda" if torch.cuda.is_available() else "cpu"]
    if lc.share_prompts:
        return build_shared_micro_batches(trajs, lc.micro_batch_tokens, pad_id, overhead)
    return build_micro_batches(trajs, lc.micro_batch_tokens, pad_id, equal_shape=lc.pp > 1, overhead_tokens=overhead)


def local_micro_batches(trajs: Sequence[Trajectory], lc: LearnerConfig, pad_id: int) -> List[MicroBatch]:
    """Micro-batches of this data-parallel replica's share of the batch."""
    return micro_batches(local_share(trajs), lc, pad_id)


def per_token_outputs(model: torch.nn.Module, trajs: Sequence[Trajectory], lc: LearnerConfig, pad_id: int,
                      step_fn: StepFn) -> List[List[float]]:
    """A forward-only pass over the whole batch, split over the data-parallel replicas: per
    response token, what ``step_fn``'s collect function returns (logprobs, values), on every rank.
    Over a replica's share (``is_local``): of its rows only, on the ranks of the replica."""
    local = local_share(trajs)  # this replica's slice; gathered below unless it is a share
    mbs = micro_batches(local, lc, pad_id) if len(local) or lc.ep > 1 else []
    result: Dict[int, List[float]] = {}
    if mbs:
        for mb, values in zip(mbs, forward_only(model, mbs, step_fn)):  # empty except on the last stage
            result.update(response_values(mb, values.cpu(), local))
    ours = from_last_stage([result.get(i) for i in range(len(local))])
    return ours if is_local(trajs) else gather_shares(ours)


def minibatch_steps(trajs: Sequence[Trajectory], lc: LearnerConfig,
                    step: Callable[[Sequence[Trajectory]], Tuple[Dict[str, float], float]],
                    ) -> Tuple[Dict[str, float], List[float]]:
    """``learner.ppo_epochs`` passes over the batch, each split into ``learner.mini_batches``
    optimizer steps; returns the summed statistics and each step's gradient norm."""
    index = getattr(trajs, "index", None)
    if is_local(trajs) and index is not None:  # a replica's share: its slice of each mini-batch
        bounds = list(index.minibatches)
    else:
        per_mini = math.ceil(len(trajs) / lc.mini_batches)
        bounds = [(start, start + per_mini) for start in range(0, len(trajs), per_mini)]
    totals: Dict[str, float] = {}
    grad_norms: List[float] = []
    for _ in range(lc.ppo_epochs):
        for start, end in bounds:
            stats, grad_norm = step(trajs[start:end])
            grad_norms.append(grad_norm)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
    return totals, grad_norms
