"""LoRA adapters on megatron-core's tensor-parallel linears (the local layer spec's
ColumnParallelLinear and RowParallelLinear).

An adapted linear computes ``W·x + s·B·(A·dropout(x))`` with ``s = alpha / rank``; W stays frozen in
the model's dtype, A [rank, in] and B [out, rank] train in fp32, B starts at zero (the model starts
as the base). Under tensor parallelism each adapter follows its linear's split:
- column-parallel (linear_qkv, linear_fc1; W split along its output): A is replicated and B split
  along the output like W. Every rank computes the same A·x from its (replicated) input; the
  low-rank activation then enters the tensor-parallel region, whose backward sums each rank's part
  of its gradient, so A's gradient is whole and equal on every rank;
- row-parallel (linear_proj, linear_fc2; W split along its input): A is split along the input like
  W and B replicated. Each rank's A_r·x_r is a partial sum, all-reduced once (a [tokens, rank]
  tensor, not the layer's output), then B applies to it on every rank.
Under sequence parallelism the same two points gather along the sequence (column) or
reduce-scatter to it (row), and the replicated adapter is marked ``sequence_parallel`` so that
megatron-core all-reduces its gradient over the tensor-parallel group as it does for norms.

The adapters live on the linear itself, as parameters ``lora_a`` and ``lora_b`` beside ``weight``:
full-model names such as ``decoder.layers.3.self_attention.linear_qkv.lora_b`` are stable,
shard like the weight in ``weights/reshard.py`` and in distributed checkpoints, and B's rows are in
the weight's row layout (a fused QKV's or gate/up's), so B converts to Hugging Face names the way
the weight does. Adding them turns the linear's class into a subclass in place (as torch's
``fully_shard`` does), after the base weights are built and loaded and before the model is wrapped
for training.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Dict, Iterator, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..errors import ConfigError

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
LORA_SYNCS = ("adapters", "merged")


# The engines that carry a LoRA learner's adapters under lora.sync=adapters, in every placement:
# the embedded engine applies them unmerged; vLLM serves them as a LoRA of its own
# (rollout/vllm/engine.py). Any other registered engine receives merged weights.
ADAPTER_ENGINES = ("embedded", "vllm")


def engine_applies_adapters(cfg) -> bool:
    """Whether this run's engines carry the adapters (lora.sync=adapters), so that each weight sync
    after the first sends the adapters alone: an engine of ``ADAPTER_ENGINES``, in every placement
    (one process, an engine rank of a torchrun world, a colocated learner rank's engine)."""
    if cfg.lora.rank <= 0 or cfg.lora.sync != "adapters":
        return False
    return cfg.rollout.engine in ADAPTER_ENGINES


def engine_lora(cfg):
    """What an engine is built with to carry the adapters: ``cfg.lora`` when it does
    (``engine_applies_adapters``), else None (it takes merged weights)."""
    return cfg.lora if engine_applies_adapters(cfg) else None


def merged_fallback(cfg, placement: str) -> str | None:
    """The one warning line of a run that asked for adapter-only sync but whose engine takes
    merged weights, None otherwise."""
    if cfg.lora.rank > 0 and cfg.lora.sync == "adapters" and not engine_applies_adapters(cfg):
        return (f"lora.sync=adapters: rollout.engine={cfg.rollout.engine} in the {placement} placement receives "
                "merged weights (W + (alpha / rank)·B·A cast to model.dtype) at every sync; adapter-only sync is "
                f"built for rollout.engine={' and '.join(ADAPTER_ENGINES)}")
    return None


def is_adapter_name(name: str) -> bool:
    """Whether a state-dict name is a LoRA adapter's (A or B)."""
    return name.endswith(ADAPTER_SUFFIXES)


class _LoraMixin:
    """What the column- and row-parallel adapted linears share (attributes set by ``_attach``)."""

    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    lora_scale: float
    lora_dropout: float
    lora_enabled: bool
    lora_dropout_on: bool
    lora_gated: bool  # a gated MLP's fc1: B's rows are [gate; up] per TP rank, like the weight's

    def _dropped(self, x: torch.Tensor, tensor_parallel_rng: bool) -> torch.Tensor:
        """The adapter's input with dropout in training forwards (not in ``dropout_disabled``). A
        replicated input draws from the default generator (the same on every TP rank, as megatron's
        hidden dropout), a TP-split one from the tensor-parallel tracker (a stream per rank, as
        attention dropout); megatron's activation recompute restores both before replaying."""
        if not (self.training and self.lora_dropout > 0 and self.lora_dropout_on):
            return x
        if not tensor_parallel_rng:
            return F.dropout(x, self.lora_dropout, training=True)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.lora_dropout, training=True)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + s·B·A, computed in fp32 and cast to W's dtype (what an engine
        without LoRA support runs)."""
        delta = self.lora_scale * (self.lora_b.float() @ self.lora_a.float())
        return (self.weight.float() + delta).to(self.weight.dtype)

    def _lora_axes(self) -> Dict[str, int]:
        raise NotImplementedError

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The linear's sharded tensors plus its adapters, each split along its own TP axis (the
        base class would call them replicated); a gated fc1's B is stored as gate and up halves,
        as megatron-core stores the weight, so a checkpoint reloads at another TP size."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(state, prefix, self._lora_axes(), sharded_offsets,
                                                      tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if self.lora_gated:
            key = f"{prefix}lora_b"
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets, singleton)
        return sharded


def _classes():
    """The two adapted linear classes, built on first use (megatron-core is imported lazily)."""
    global _COLUMN, _ROW
    if _COLUMN is not None:
        return _COLUMN, _ROW
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
        """ColumnParallelLinear + LoRA: A replicated, B split along the output."""

        def forward(self, input_, weight=None, runtime_gather_output=None):
            output, bias = super().forward(input_, weight, runtime_gather_output)
            if not self.lora_enabled:
                return output, bias
            low = F.linear(self._dropped(input_, False).to(self.lora_a.dtype), self.lora_a)
            if self.sequence_parallel:  # the input is this rank's part of the sequence
                low = mappings.gather_from_sequence_parallel_region(low, tensor_parallel_output_grad=True,
                                                                    group=self.tp_group)
            else:  # identity forward; the backward sums the ranks' parts of the gradient
                low = mappings.copy_to_tensor_model_parallel_region(low, group=self.tp_group)
            return output + (self.lora_scale * F.linear(low, self.lora_b)).to(output.dtype), bias

        def _lora_axes(self) -> Dict[str, int]:
            return {"weight": 0, "bias": 0, "lora_b": 0}

    class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
        """RowParallelLinear + LoRA: A split along the input, B replicated."""

        def forward(self, input_):
            output, bias = super().forward(input_)
            if not self.lora_enabled:
                return output, bias
            partial = F.linear(self._dropped(input_, True).to(self.lora_a.dtype), self.lora_a)
            if self.sequence_parallel:
                low = mappings.reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
            else:  # the one all-reduce of the low-rank path: rank-sized, not the output's size
                low = mappings.reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
            return output + (self.lora_scale * F.linear(low, self.lora_b)).to(output.dtype), bias

        def _lora_axes(self) -> Dict[str, int]:
            return {"weight": 1, "lora_a": 1}

    _COLUMN, _ROW = LoraColumnParallelLinear, LoraRowParallelLinear
    return _COLUMN, _ROW


_COLUMN = _ROW = None


def _init_a(full_shape: Tuple[int, int], key: str, seed: int) -> torch.Tensor:
    """A's full initial value: Kaiming-uniform as PEFT's (bound 1/sqrt(in)), from a generator of
    its own seeded by (seed, full name), so every layout and every rank draws the same A and the
    global random streams (the base's init, the engines' sampling) are untouched."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    bound = 1.0 / math.sqrt(full_shape[1])
    return (torch.rand(full_shape, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _attach(module: torch.nn.Module, cls: type, key: str, rank: int, alpha: float, dropout: float,
            seed: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    column = cls is _COLUMN
    if column and module.gather_output:
        raise ValueError(f"{key}: LoRA on a column-parallel linear that gathers its output is not supported")
    if not column and not module.input_is_parallel:
        raise ValueError(f"{key}: LoRA on a row-parallel linear whose input is not split is not supported")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    weight = module.weight
    device = weight.device
    out_local, in_local = weight.shape
    in_full = in_local if column else in_local * tp
    a_full = _init_a((rank, in_full), key, seed)
    a = a_full if column else torch.chunk(a_full, tp, dim=1)[tp_rank]
    module.__class__ = cls
    module.lora_a = torch.nn.Parameter(a.contiguous().to(device))
    module.lora_b = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=torch.float32, device=device))
    # Megatron's attributes: which of the two is split over TP and along which axis (grad-norm
    # counting, resharding, checkpoints); the replicated one's gradient is TP-summed under SP.
    split, replicated = (module.lora_b, module.lora_a) if column else (module.lora_a, module.lora_b)
    set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
    if module.sequence_parallel:
        replicated.sequence_parallel = True
    module.lora_scale = alpha / rank
    module.lora_dropout = dropout
    module.lora_enabled = True
    module.lora_dropout_on = True
    config = module.config
    module.lora_gated = column and bool(config.gated_linear_unit) and key.endswith("linear_fc1")


def add_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: Sequence[str],
             seed: int = 0) -> int:
    """Freeze every weight of a built GPTModel and give the ``targets`` projections of every
    transformer layer an adapter; returns how many linears got one. Raises ValueError naming a
    target this model has no plain (local-spec) linear for."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    column_cls, row_cls = _classes()
    model.requires_grad_(False)
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    found = {t: 0 for t in targets}
    for layer in layers:
        global_layer = int(layer.layer_number) - 1  # megatron numbers layers from 1, over all stages
        for name, module in list(layer.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in found or ".experts." in f".{name}." or "shared_experts" in name:
                continue
            key = f"decoder.layers.{global_layer}.{name}"
            if isinstance(module, ColumnParallelLinear):
                _attach(module, column_cls, key, rank, alpha, dropout, seed)
            elif isinstance(module, RowParallelLinear):
                _attach(module, row_cls, key, rank, alpha, dropout, seed)
            else:
                raise ValueError(f"lora.targets: {key} is a {type(module).__name__}, not megatron-core's "
                                 "ColumnParallelLinear/RowParallelLinear of the local layer spec")
            found[leaf] += 1
    if getattr(model.config, "recompute_granularity", None) and getattr(model, "embedding", None) is not None:
        # Megatron's recompute wraps each layer in an autograd function whose output needs grad
        # only if its input does: with the embedding frozen, the first layers' adapters would get none.
        model.embedding.register_forward_hook(_output_requires_grad)
    if layers:
        missing = [t for t, n in found.items() if n == 0]
        if missing:
            raise ValueError(f"lora.targets: this model has no {', '.join(missing)} outside routed experts "
                             f"(a dense layer's projections are {', '.join(LORA_TARGETS)})")
    return sum(found.values())


def _output_requires_grad(module, args, output):
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


def adapted_linears(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """The adapted linears by their weight's state-dict name (``...linear_qkv.weight``)."""
    if _COLUMN is None:
        return {}
    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, (_COLUMN, _ROW))}


def export_state(model: torch.nn.Module, merge: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """The model's state-dict tensors (parameters as themselves). With ``merge`` each adapted
    linear's weight is replaced by its merged shard and the adapters are left out: what an engine
    without LoRA loads. A model without adapters gives its state dict unchanged either way."""
    linears = adapted_linears(model) if merge else {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        if linears and is_adapter_name(name):
            continue
        linear = linears.get(name)
        yield name, (linear.merged_weight() if linear is not None else tensor)


@contextlib.contextmanager
def _all_set(model: torch.nn.Module, attribute: str, value: bool) -> Iterator[None]:
    linears = list(adapted_linears(model).values())
    for linear in linears:
        setattr(linear, attribute, value)
    try:
        yield
    finally:
        for linear in linears:
            setattr(linear, attribute, not value)


def adapters_disabled(model: torch.nn.Module):
    """Forwards inside the block run the base model (the reference policy of a KL penalty)."""
    return _all_set(model, "lora_enabled", False)


def dropout_disabled(model: torch.nn.Module):
    """Forwards inside the block apply no adapter dropout (logprobs that score the policy itself)."""
    return _all_set(model, "lora_dropout_on", False)


def trainable_parameters(model: torch.nn.Module) -> int:
    """How many numbers the optimizer trains on this rank."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_lora(cfg) -> None:
    """LoRA's keys (lora.*), and the models it cannot adapt yet."""
    lo, m = cfg.lora, cfg.model
    if lo.rank < 0:
        raise ConfigError(f"lora.rank={lo.rank} must be >= 0 (0 trains every weight; e.g. 8 or 16 for LoRA)")
    if not lo.rank:
        return
    if not lo.alpha > 0:
        raise ConfigError(f"lora.alpha={lo.alpha} must be > 0 (the update is scaled by alpha / rank; e.g. 32)")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout={lo.dropout} must be in [0, 1)")
    unknown = [t for t in lo.targets if t not in LORA_TARGETS]
    if unknown or not lo.targets or len(set(lo.targets)) != len(lo.targets):
        raise ConfigError(f"lora.targets={list(lo.targets)} must list distinct projections of "
                          f"{', '.join(LORA_TARGETS)} (at least one)")
    mlp = [t for t in lo.targets if t in ("linear_fc1", "linear_fc2")]
    if m.num_experts and mlp:
        raise ConfigError(f"lora.targets has {', '.join(mlp)}, but model.num_experts={m.num_experts}: LoRA on routed "
                          "experts is not built; adapt attention only (lora.targets=[linear_qkv,linear_proj])")
    if m.kv_lora_rank is not None and "linear_qkv" in lo.targets:
        raise ConfigError("lora.targets has linear_qkv, but multi-head latent attention (model.kv_lora_rank) has "
                          "no fused QKV projection; drop it from lora.targets")
