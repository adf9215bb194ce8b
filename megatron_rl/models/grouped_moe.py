"""Mixture-of-experts layers whose local experts run as one grouped matmul per projection.

megatron-core's ``SequentialMLP`` loops over the local experts (128 launches of three small
matmuls per layer for Qwen3-30B-A3B), and its ``GroupedMLP``/``TEGroupedMLP`` need the
``grouped_gemm`` CUDA extension or TransformerEngine. ``torch._grouped_mm`` multiplies every
expert's rows by that expert's weight in one kernel (CUTLASS on sm90, a reference loop on CPU),
with the group boundaries as a device tensor, so nothing waits for the host.

- ``GroupedExperts`` is a ``SequentialMLP`` (same per-expert parameters, state dicts, checkpoint
  layout, Hugging Face names) whose forward runs the two grouped matmuls. Under megatron-core's
  token dispatchers (expert or tensor parallelism) it is a drop-in replacement for the loop. The
  learner's models hold each layer's experts as two stacked parameters instead
  (``stack_expert_parameters``), behind hooks that keep the per-expert state-dict names and
  distributed-checkpoint layout.
- ``GroupedMoELayer`` is a ``MoELayer`` that, with one expert-parallel and one tensor-parallel
  rank, routes, sorts tokens by expert and combines their outputs on the device with static
  shapes (every token has exactly top-k rows): no ``.cpu()``, no ``.tolist()``, so the rollout
  engine's decode step can be captured in a CUDA graph. It can also keep each forward's chosen
  experts (``record_choices``) for routing replay (models/routing.py).
- ``stack_expert_weights`` (rollout engine) makes each layer's per-expert weights views of one
  stacked tensor, so decode steps read them in place instead of stacking them every step.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from ..compiled import CompiledOrEager
from megatron.core.transformer.moe.moe_layer import MoELayer

# Expert ids fit one byte below this many experts (255 marks "unrecorded"); more need two.
_BYTE_EXPERTS = 256


def choice_dtype(num_experts: int) -> torch.dtype:
    """The compact integer type for recorded expert ids (8 bits below 256 experts: 255 marks "unrecorded")."""
    return torch.uint8 if num_experts < _BYTE_EXPERTS else torch.int16


def grouped_mm_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs for this dtype on this device: bf16 on Hopper or newer
    GPUs; fp32/bf16/fp16 on CPU (a reference implementation there)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return False


class _GroupedLinear(torch.autograd.Function):
    """``out[rows of expert e] = x[rows of e] @ w[e].T`` for every local expert in one call.

    ``x`` [rows, in] sorted by expert, ``w`` [experts, out, in] (nn.Linear's layout, stacked),
    ``ends`` int32 [experts]: the cumulative row count after each expert. torch registers a
    derivative for ``_grouped_mm`` too, but it fails on a non-contiguous incoming gradient (an
    expanded ``sum()`` gradient, for one); the three products are spelled out here instead."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, ends)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, ends = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, w, offs=ends)
        if ctx.needs_input_grad[1]:
            grad_w = _grouped_weight_grad(grad, x, ends)
        return grad_x, grad_w, None


def _zero_unrouted(grad_w: torch.Tensor, routed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad_w`` in ``dtype`` with the experts that got no rows zeroed."""
    return torch.where(routed[:, None, None], grad_w, 0).to(dtype)


# One pass on a GPU (eagerly, the conversion and the selection are two: ~14 bytes moved per
# weight instead of 6, ~4 ms per step for 4 layers of 128 Qwen3-30B-A3B experts).
_ZERO_UNROUTED = CompiledOrEager(_zero_unrouted, "expert weight-gradient conversion")


def _add_routed(main_grad: torch.Tensor, grad_w: torch.Tensor, routed: torch.Tensor) -> None:
    """``main_grad += grad_w`` (converted to its dtype) for the experts that got rows."""
    main_grad.add_(torch.where(routed[:, None, None], grad_w.to(main_grad.dtype), 0))


# One pass on a GPU: reads the bf16 gradient and the fp32 buffer, writes the buffer (~10 bytes
# per weight; converting, then adding, moves ~18).
_ADD_ROUTED = CompiledOrEager(_add_routed, "expert weight-gradient accumulation")


def _raw_weight_grad(grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad[rows of e].T @ x[rows of e] for every expert e, whether e got rows): an expert with
    no rows may be left unwritten by the kernel, so its entry must be read as zero."""
    # Groups along the shared (row) dimension.
    grad_w = torch._grouped_mm(grad.t(), x, offs=ends)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return grad_w, counts > 0


def _grouped_weight_grad(grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor,
                         dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """grad_w[e] = grad[rows of e].T @ x[rows of e], zero for an expert with no rows, in
    ``dtype`` (the inputs' if None)."""
    grad_w, routed = _raw_weight_grad(grad, x, ends)
    return _ZERO_UNROUTED(grad_w, routed, dtype or grad_w.dtype)


class _GroupedLinearIntoMainGrad(torch.autograd.Function):
    """``_GroupedLinear`` for weights wrapped by Megatron's data-parallel module: the weight
    gradient is added straight into the fp32 ``main_grad`` buffers: one per expert (per-expert
    parameters, one multi-tensor add) or one for the stacked parameter. Through autograd it would
    go through each parameter's gradient-accumulation node and hook (per expert: ~1,000 of each
    per step for 4 layers of 128 experts, host-bound) and a bf16 ``grad`` before the fp32 add.
    ``w`` is the detached (stack of the) weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, main_grads,
                zeroed: Optional["ZeroedBuffers"] = None, key: str = "") -> torch.Tensor:
        ctx.save_for_backward(x, w, ends)
        ctx.main_grads, ctx.zeroed, ctx.key = main_grads, zeroed, key
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, ends = ctx.saved_tensors
        grad = grad.contiguous()
        # In the buffers' dtype (fp32): the multi-tensor add takes its fused path only for lists of
        # one dtype (mixed, it adds tensor by tensor).
        main_grads = ctx.main_grads
        if len(main_grads) == 1 and main_grads[0].dim() == 3:  # one stacked parameter
            raw = _raw_weight_grad(grad, x, ends)
            if ctx.zeroed is not None and ctx.zeroed.take(ctx.key):
                # The buffer holds zeros: write instead of add (no read of the fp32 buffer).
                main_grads[0].copy_(_ZERO_UNROUTED(*raw, main_grads[0].dtype))
            else:
                _ADD_ROUTED(main_grads[0], *raw)
        else:
            grad_w = _grouped_weight_grad(grad, x, ends, main_grads[0].dtype)
            torch._foreach_add_(main_grads, list(grad_w.unbind(0)))
        return torch._grouped_mm(grad, w, offs=ends), None, None, None, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of ``x`` times that expert's ``w[e].T`` (see ``_GroupedLinear``)."""
    if grouped_mm_supported(x.dtype, x.device):
        return _GroupedLinear.apply(x, w, ends)
    # Exact fallback (fp32 on a GPU, say): one matmul per expert, split sizes from the host.
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    parts = [chunk @ w[e].t() for e, chunk in enumerate(torch.split(x, counts))]
    return torch.cat(parts) if parts else x.new_zeros(0, w.size(1))


# Below this many (rows x experts) the sort by expert counts instead of sorting: a decode step's
# 2,048 rows over 128 experts; above it (prefill, training) a radix sort is cheaper.
COUNTING_SORT_MAX = 1 << 22


def rows_by_expert(expert_of_row: torch.Tensor, counts: torch.Tensor,
                   ends: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse): ``order`` lists the rows grouped by expert, each expert's rows in row
    order (a stable sort by expert id), and ``inverse[row]`` is the row's place in it. For few
    rows the place is computed directly (the row's expert's start plus how many of that expert's
    rows come before it: a cumulative count over an experts x rows table), fewer passes than the
    radix sort in a decode step; both give the same permutation."""
    rows, experts = expert_of_row.numel(), counts.numel()
    arange = torch.arange(rows, device=expert_of_row.device)
    if rows * experts > COUNTING_SORT_MAX:
        order = torch.argsort(expert_of_row, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = arange
        return order, inverse
    # Experts x rows, counted along the rows: a scan along the inner dimension (one along the
    # outer one, rows x experts, ran 0.36 ms per layer on an H200, slower than the sort).
    one_hot = torch.arange(experts, device=expert_of_row.device)[:, None] == expert_of_row[None, :]
    before = one_hot.cumsum(1, dtype=torch.int32).gather(0, expert_of_row[None, :]).squeeze(0) - 1
    inverse = ((ends - counts)[expert_of_row] + before).long()
    order = torch.empty_like(inverse)
    order[inverse] = arange
    return order, inverse


class _RowsByExpert(torch.autograd.Function):
    """Each token's row repeated for its k experts, in expert order: ``x[order // k]``. Its
    gradient gathers the rows back to token order and sums each token's k (no atomic
    scatter-add: index_select's own backward is one, ~2 ms per layer at 131k rows on an H200,
    and its summation order varies between runs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        by_token = grad.index_select(0, inverse).view(-1, ctx.k, grad.size(-1))
        return torch.sum(by_token, dim=1, dtype=torch.float32).to(grad.dtype), None, None, None


class _RowsByToken(torch.autograd.Function):
    """Expert-ordered rows put back in token order, ``rows[inverse]``; a permutation, so the
    gradient is a gather too (``grad[order]``) rather than a scatter-add."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(order)
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None


class ZeroedBuffers:
    """Which of a layer's gradient buffers are known to hold zeros: marked when the data-parallel
    wrapper zeroes its buffers, taken (and cleared) by the first backward that writes one. Adding
    a weight gradient into a zeroed fp32 buffer reads it for nothing: for 4 layers of 128
    Qwen3-30B-A3B experts that read is ~10 GB, ~2.5 ms per step on an H200."""

    KEYS = ("fc1", "fc2")

    def __init__(self) -> None:
        self._zeroed: set = set()

    def mark(self) -> None:
        self._zeroed = set(self.KEYS)

    def take(self, key: str) -> bool:
        """Whether buffer ``key`` holds zeros; from now on it does not (the caller writes it)."""
        if key in self._zeroed:
            self._zeroed.discard(key)
            return True
        return False


class GroupedExperts(SequentialMLP):
    """The local experts of one MoE layer as grouped matmuls (same parameters as SequentialMLP,
    or, after ``stack_parameters``, the same weights as two stacked parameters)."""

    # The stacked parameters' names (``stack_parameters``): [experts, out, in] each.
    STACKED = ("linear_fc1_weights", "linear_fc2_weights")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Set by stack_expert_weights (engine): stacked [experts, out, in] tensors the per-expert
        # weights are views of.
        self.stacked: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        # Set by stack_parameters (learner): the weights are two stacked parameters.
        self.parameters_stacked = False
        # Set by accumulate_expert_grads_into_main_grad (learner): weight gradients go straight
        # into the data-parallel wrapper's main_grad buffers.
        self.into_main_grad = False
        # Which stacked weights' main_grad buffers hold zeros (set when the wrapper zeroes them):
        # their first weight gradient is written, not added.
        self.zeroed = ZeroedBuffers()

    def _grouped_supported(self) -> bool:
        config = self.config
        return (config.gated_linear_unit and config.activation_func is F.silu and not config.add_bias_linear
                and not (config.fp8 or config.fp4) and config.moe_latent_size is None
                and getattr(config, "activation_func_clamp_value", None) is None
                and getattr(config, "glu_linear_offset", 0.0) == 0.0)

    def weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(fc1 [experts, 2·ffn, hidden], fc2 [experts, hidden, ffn]) of the local experts."""
        if self.parameters_stacked:
            return self.linear_fc1_weights, self.linear_fc2_weights
        if self.stacked is not None:
            return self.stacked
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])
        return fc1, fc2

    def first_weight(self) -> Optional[torch.Tensor]:
        """A weight of the local experts (its dtype and device are all of theirs), None without."""
        if self.parameters_stacked:
            return self.linear_fc1_weights
        return self.local_experts[0].linear_fc1.weight if self.local_experts else None

    # ------------------------------------------------------------------ stacked parameters
    @torch.no_grad()
    def stack_parameters(self) -> bool:
        """Hold the local experts' weights as two parameters, fc1 [experts, 2·ffn, hidden] and
        fc2 [experts, hidden, ffn], instead of two per expert: what a trained model wants.
        Megatron's data-parallel wrapper and optimizer handle each parameter in Python loops
        (gradient hooks, fp32 copies, norms, the copy-back): with 128 experts × 4 layers that was
        1,024 tensors, ~30-40 ms of host time per step while the GPU idled, and each forward
        copied the weights into a stack for the grouped matmuls. Call before the model is wrapped
        for training. State dicts and distributed checkpoints keep SequentialMLP's per-expert
        names and layout (hooks below), so checkpoints, Hugging Face conversion and weight
        updates see no difference. Only where the grouped matmuls run and one expert-TP rank
        holds whole experts; returns whether the layer was stacked."""
        if (self.parameters_stacked or self.stacked is not None or not self.local_experts
                or not self._grouped_supported() or self.config.moe_apply_probs_on_input
                or self.tp_group.size() != 1):
            return False
        for projection, name in zip(("linear_fc1", "linear_fc2"), self.STACKED):
            per_expert = [getattr(e, projection).weight for e in self.local_experts]
            stacked = torch.nn.Parameter(torch.stack([w.detach() for w in per_expert]),
                                         requires_grad=per_expert[0].requires_grad)
            # Megatron's markers (expert vs data-parallel reduction, TP split): the expert axis
            # comes first now, so a TP partition dimension moves one along.
            for attr, value in vars(per_expert[0]).items():
                if not attr.startswith("_"):
                    setattr(stacked, attr, value + 1 if attr == "partition_dim" else value)
            setattr(self, name, stacked)
        self.local_experts = torch.nn.ModuleList()
        self.parameters_stacked = True
        self.register_state_dict_post_hook(_per_expert_state)
        self.register_load_state_dict_pre_hook(_stacked_state)
        return True

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """SequentialMLP's distributed-checkpoint layout for the stacked parameters: each weight
        under ``<prefix>experts.linear_fc{1,2}.weight`` as a [global experts, out, in] tensor
        (fc1's gate and up halves as two pieces), so a checkpoint loads into either layout."""
        if not self.parameters_stacked:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

        ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        num_global = ep_size * self.num_local_experts
        first_global = ep_rank * self.num_local_experts
        axis = len(sharded_offsets)  # the expert axis: the stacked tensors' first
        replica_id = (0, 0, self.dp_group.rank())
        expert_axis = (axis, ep_rank, ep_size)

        def fc1_pieces(key, tensor, replica, flattened_range):
            gate, up = torch.chunk(tensor, 2, dim=1)
            return [ShardedTensor.from_rank_offsets(key, half.contiguous(), *sharded_offsets, expert_axis,
                                                    (axis + 1, i, 2), replica_id=replica, prepend_axis_num=axis)
                    for i, half in enumerate((gate, up))]

        def fc1_merge(pieces):
            return torch.cat(pieces, dim=1)

        out = {f"{prefix}{self.STACKED[0]}": ShardedTensorFactory(
            f"{prefix}experts.linear_fc1.weight", self.linear_fc1_weights, fc1_pieces, fc1_merge, replica_id)}
        out[f"{prefix}{self.STACKED[1]}"] = ShardedTensor.from_rank_offsets(
            f"{prefix}experts.linear_fc2.weight", self.linear_fc2_weights, *sharded_offsets, expert_axis,
            replica_id=replica_id, prepend_axis_num=axis)
        # SequentialMLP's linears also save an (empty) extra state per expert: the same objects,
        # so a SequentialMLP model loads this checkpoint too.
        for local in range(self.num_local_experts):
            offsets = (*sharded_offsets, (axis, first_global + local, num_global))
            for projection in ("linear_fc1", "linear_fc2"):
                out[f"{prefix}local_experts.{local}.{projection}._extra_state"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{projection}._extra_state", offsets, replica_id)
        return out

    # ------------------------------------------------------------------ forward
    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """SequentialMLP's interface: rows sorted by local expert, ``tokens_per_expert`` counts
        (on the host or the device)."""
        if not self.parameters_stacked and (not self._grouped_supported() or self.config.moe_apply_probs_on_input):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        # (a host tensor, or numpy where the CPU patches keep the alltoall's split sizes so)
        ends = torch.as_tensor(tokens_per_expert).to(device=x.device).cumsum(0).to(torch.int32)
        return self.compute(x, ends, permuted_probs), None

    def compute(self, x: torch.Tensor, ends: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Expert outputs for rows ``x`` sorted by expert (``ends``: cumulative counts), each
        row's SwiGLU output scaled by its routing probability before the down projection, as
        megatron-core's MLP does for experts."""
        if self._into_main_grad(x):
            if self.parameters_stacked:
                fc1s, fc2s = [self.linear_fc1_weights], [self.linear_fc2_weights]
                fc1, fc2 = fc1s[0].detach(), fc2s[0].detach()
            else:
                fc1s = [e.linear_fc1.weight for e in self.local_experts]
                fc2s = [e.linear_fc2.weight for e in self.local_experts]
                fc1 = torch.stack([w.detach() for w in fc1s])
                fc2 = torch.stack([w.detach() for w in fc2s])
            hidden = _GroupedLinearIntoMainGrad.apply(x, fc1, ends, [w.main_grad for w in fc1s], self.zeroed, "fc1")
            hidden = self._swiglu_times_probs(hidden, probs)
            return _GroupedLinearIntoMainGrad.apply(hidden, fc2, ends, [w.main_grad for w in fc2s], self.zeroed,
                                                    "fc2")
        fc1, fc2 = self.weights()
        hidden = grouped_linear(x, fc1, ends)
        hidden = self._swiglu_times_probs(hidden, probs)
        return grouped_linear(hidden, fc2, ends)

    def _into_main_grad(self, x: torch.Tensor) -> bool:
        """Whether this forward's weight gradients go straight into ``main_grad``: switched on,
        a forward that builds a graph through ``x`` (otherwise no backward would run to add them),
        trainable weights with gradient buffers, grouped matmuls on this device."""
        first = self.first_weight()
        if not (self.into_main_grad and self.stacked is None and torch.is_grad_enabled() and x.requires_grad
                and first is not None and grouped_mm_supported(x.dtype, x.device)):
            return False
        if self.parameters_stacked:
            weights = [self.linear_fc1_weights, self.linear_fc2_weights]
        else:
            weights = [w for e in self.local_experts for w in (e.linear_fc1.weight, e.linear_fc2.weight)]
        return all(getattr(w, "main_grad", None) is not None and w.requires_grad for w in weights)

    def _swiglu_times_probs(self, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if self.config.bias_activation_fusion:
            # megatron-core's fused (compiled) kernel, as its MLP uses on a GPU.
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(hidden, None, probs.unsqueeze(-1), False)
        gate, up = torch.chunk(hidden, 2, dim=-1)
        out = F.silu(gate) * up
        return (out * probs.unsqueeze(-1)).to(hidden.dtype)


def _per_expert_state(module: "GroupedExperts", state_dict, prefix: str, local_metadata) -> None:
    """State-dict hook of stacked experts: SequentialMLP's per-expert entries (views of the
    stacked weights, no copies) in place of the two stacked ones."""
    for projection, name in zip(("linear_fc1", "linear_fc2"), GroupedExperts.STACKED):
        stacked = state_dict.pop(prefix + name, None)
        if stacked is None:
            continue
        for e, weight in enumerate(stacked.detach().unbind(0)):
            state_dict[f"{prefix}local_experts.{e}.{projection}.weight"] = weight
            state_dict[f"{prefix}local_experts.{e}.{projection}._extra_state"] = None


def _stacked_state(module: "GroupedExperts", state_dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook of stacked experts: SequentialMLP's per-expert entries stacked
    into the two parameters' (a state dict of stacked entries loads as it is)."""
    for projection, name in zip(("linear_fc1", "linear_fc2"), GroupedExperts.STACKED):
        keys = [f"{prefix}local_experts.{e}.{projection}.weight" for e in range(module.num_local_experts)]
        if all(k in state_dict for k in keys):
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])
        for e in range(module.num_local_experts):
            state_dict.pop(f"{prefix}local_experts.{e}.{projection}._extra_state", None)


class GroupedMoELayer(MoELayer):
    """An MoE layer that keeps routing, the sort by expert and the combine on the device when
    no expert or tensor parallelism splits it (megatron-core's dispatchers otherwise)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Routing replay (models/routing.py): when set, each device-path forward keeps its chosen
        # experts in ``choices`` ([tokens, top-k], ascending per token, compact ints; tokens in the
        # router's order: [s, b] flattened sequence-major). Under CUDA-graph replay the tensor is
        # the graph's static output: read it after each replay.
        self.record_choices = False
        self.choices: Optional[torch.Tensor] = None
        # Position of this layer among the model's MoE layers (all pipeline stages); set by
        # routing.number_moe_layers.
        self.moe_index: Optional[int] = None

    def on_device_path(self) -> bool:
        config = self.config
        return (self.ep_group.size() == 1 and self.tp_group.size() == 1
                and getattr(self.experts, "tp_group", self.tp_group).size() == 1
                and isinstance(self.experts, GroupedExperts) and self.experts._grouped_supported()
                and not config.moe_apply_probs_on_input and not self.moe_layer_recompute
                and not self.shared_expert_overlap and config.moe_latent_size is None
                # Token dropping leaves rows with fewer than top-k experts: not a static shape.
                and config.moe_expert_capacity_factor is None)

    def without_host_sync(self) -> bool:
        """Whether an inference forward (no autograd) never waits for the host, so a CUDA graph
        can capture it: the device path, grouped matmuls that run on this dtype and device (the
        fallback splits rows by counts read on the host), and a router whose no-grad forward only
        does top-k arithmetic. megatron-core's TopKRouter under no_grad skips its aux and z
        losses and the expert-bias token counter (all gated on grad mode), and its fp32 expert
        bias is converted once, by the first forward, before any capture; input jitter, forced
        load balancing, Sinkhorn, TransformerEngine's fused top-k and token dropping are left out."""
        config = self.config
        fc1 = self.experts.first_weight() if isinstance(self.experts, GroupedExperts) else None
        return (self.on_device_path() and fc1 is not None and grouped_mm_supported(fc1.dtype, fc1.device)
                and getattr(self.router, "routing_type", "none") != "sinkhorn"
                and config.moe_input_jitter_eps is None and not config.moe_router_force_load_balancing
                and not config.moe_router_fusion and not config.moe_enable_routing_replay)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        if intermediate_tensors is not None or not self.on_device_path():
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        output = self.experts_on_device(hidden_states, probs, routing_map)
        if shared_output is not None:
            output = output + shared_output
        return output, None

    def experts_on_device(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                          routing_map: torch.Tensor) -> torch.Tensor:
        """Every token's top-k expert outputs, weighted by its routing probabilities and summed,
        from device tensors of fixed size (tokens · top-k rows)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        k = self.config.moe_router_topk
        # The k chosen experts of each token, ascending: exactly k entries of each map row are set.
        choice = torch.topk(routing_map.to(torch.int32), k, dim=1, sorted=False).indices.sort(dim=1).values
        if self.record_choices:
            self.choices = choice.to(choice_dtype(self.config.num_moe_experts))
        counts = routing_map.sum(dim=0, dtype=torch.int32)
        ends = counts.cumsum(0, dtype=torch.int32)
        order, inverse = rows_by_expert(choice.reshape(-1), counts, ends)
        rows = _RowsByExpert.apply(x, order, inverse, k)
        row_probs = probs.gather(1, choice).reshape(-1).index_select(0, order)
        out = self.experts.compute(rows, ends, row_probs)
        # Back to token-major order, then each token's k outputs summed in fp32.
        out = _RowsByToken.apply(out, order, inverse).view(-1, k, shape[-1])
        return torch.sum(out, dim=1, dtype=torch.float32).to(hidden_states.dtype).view(shape)


class _KnownMoELayer(logging.Filter):
    """megatron-core's TransformerLayer recognises MoELayer by identity and warns "Unknown MLP
    type" for a subclass; the process groups it then leaves out are the defaults MoELayer takes
    anyway, so the warning says nothing here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


def use_grouped_experts(spec) -> None:
    """Point a block spec's MoE layers at ``GroupedMoELayer`` with ``GroupedExperts`` (in place;
    only layers built with megatron-core's local SequentialMLP change)."""
    layer_logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    if not any(isinstance(f, _KnownMoELayer) for f in layer_logger.filters):
        layer_logger.addFilter(_KnownMoELayer())
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        mlp = getattr(layer.submodules, "mlp", None)
        if getattr(mlp, "module", None) is not MoELayer:
            continue
        experts = mlp.submodules.experts
        if getattr(experts, "module", None) is SequentialMLP:
            mlp.module = GroupedMoELayer
            experts.module = GroupedExperts


def stack_expert_parameters(model: torch.nn.Module) -> int:
    """Hold every GroupedExperts' weights as two stacked parameters (``GroupedExperts.
    stack_parameters``: for models that train or run the learner's forwards; call before
    wrapping for training). Returns the number of layers stacked."""
    return sum(module.stack_parameters() for module in model.modules() if isinstance(module, GroupedExperts))


def mark_expert_grads_zeroed(model: torch.nn.Module) -> None:
    """Tell every GroupedExperts of ``model`` that its main_grad buffers were just zeroed (called
    by the data-parallel wrapper's ``zero_grad_buffer``)."""
    for module in model.modules():
        if isinstance(module, GroupedExperts) and module.into_main_grad and module.parameters_stacked:
            module.zeroed.mark()


def accumulate_expert_grads_into_main_grad(model: torch.nn.Module) -> int:
    """Let every GroupedExperts of a model wrapped by megatron-core's DistributedDataParallel add
    its weight gradients straight into the parameters' ``main_grad`` buffers, bypassing the
    per-parameter hooks. Only for a wrapper that does not overlap gradient reduction with the
    backward (its hooks then only add ``grad`` into ``main_grad``; the reduction reads the
    buffers after the backward). Returns the number of layers switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.into_main_grad = True
            switched += 1
    return switched


@torch.no_grad()
def stack_expert_weights(model: torch.nn.Module) -> int:
    """Make every GroupedExperts' per-expert weights views of two stacked tensors (for models that
    only run forwards: the rollout engine). Weight loads copy into the parameters as before and
    so land in the stacked tensors. Call after the model is on its device. Returns the number of
    layers stacked."""
    stacked = 0
    for module in model.modules():
        if not isinstance(module, GroupedExperts) or not module._grouped_supported():
            continue
        fc1, fc2 = module.weights()
        fc1, fc2 = fc1.contiguous(), fc2.contiguous()
        for e, expert in enumerate(module.local_experts):
            expert.linear_fc1.weight.data = fc1[e]
            expert.linear_fc2.weight.data = fc2[e]
        module.stacked = (fc1, fc2)
        stacked += 1
    return stacked
