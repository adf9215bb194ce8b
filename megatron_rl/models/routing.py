"""Routing replay (R3): the learner routes each token to the experts the rollout engine chose.

A mixture-of-experts router picks its top-k experts from logits that differ in the last bits
between the engine's forward and the learner's (other kernels, batch shapes, bf16 rounding), so
about a tenth of the choices differ and most tokens see a different expert in some layer: the
learner then scores tokens with another network than the one that sampled them. The engine
records each MoE layer's chosen experts for every token it computes (``record_routing`` +
``recorded_choices``), and the learner replays them in its forwards (``RoutingReplay``) through
megatron-core's ``RouterReplay`` hook in the router's top-k.

Choices are ``[moe_layers, tokens, top_k]`` integer tensors (uint8 up to 256 experts), tokens in
the router's order: a forward's [s, b] positions flattened sequence-major. An entry of -1 (255
in uint8, -1 in int16) means "nothing recorded": that token routes by the learner's own router
(a response's last token, which the engine never feeds back, and padding).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from .grouped_moe import GroupedMoELayer
from ..errors import ConfigError

UNRECORDED = -1


def moe_layers(model: torch.nn.Module) -> List[GroupedMoELayer]:
    """This pipeline stage's MoE layers in layer order, each numbered (``moe_index``) among all
    the model's MoE layers."""
    layers = [m for m in model.modules() if isinstance(m, GroupedMoELayer)]
    if layers and layers[0].moe_index is None:
        number_moe_layers(layers)
    return layers


def foreign_moe_layers(model: torch.nn.Module) -> int:
    """How many of the model's MoE layers are megatron-core's own (SequentialMLP under
    ``model.moe_grouped_experts=false``, TransformerEngine's grouped MLP), which record nothing and
    which ``RoutingReplay`` does not attach to."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return sum(isinstance(m, MoELayer) and not isinstance(m, GroupedMoELayer) for m in model.modules())


def number_moe_layers(layers: Sequence[GroupedMoELayer]) -> None:
    """Set each layer's ``moe_index`` from its global layer number and the config's MoE pattern
    (``moe_layer_freq``: an int period or a 0/1 list over all layers)."""
    index_of_layer, count = {}, 0
    for number, is_moe in enumerate(moe_pattern(layers[0].config), start=1):
        if is_moe:
            index_of_layer[number] = count
            count += 1
    for layer in layers:
        layer.moe_index = index_of_layer[layer.layer_number]


def moe_pattern(config) -> List[int]:
    """1 for each MoE layer, 0 for each dense one, over all layers (megatron-core's
    ``moe_layer_freq``: a 0/1 list, or an int period)."""
    freq = config.moe_layer_freq
    if isinstance(freq, (list, tuple)):
        return [int(f) for f in freq]
    return [int(i % freq == 0) for i in range(config.num_layers)]


def num_moe_layers(config) -> int:
    """How many MoE layers the whole model has (every pipeline stage)."""
    return sum(moe_pattern(config))


def record_routing(model: torch.nn.Module, on: bool = True) -> None:
    """Make every MoE layer keep its chosen experts after each forward (``recorded_choices``)."""
    for layer in moe_layers(model):
        layer.record_choices = on
        if not on:
            layer.choices = None


def recorded_choices(model: torch.nn.Module) -> torch.Tensor:
    """The last forward's choices of this stage's MoE layers: [layers, tokens, top_k]."""
    layers = moe_layers(model)
    missing = [layer.layer_number for layer in layers if layer.choices is None]
    if missing:
        raise RuntimeError(f"MoE layers {missing} recorded no routing: call record_routing(model) before the "
                           "forward, and run them on the device path (one expert- and tensor-parallel rank)")
    return torch.stack([layer.choices for layer in layers])


class _LayerReplay:
    """Stands in for megatron-core's ``RouterReplay`` on one router (same ``get_replay_topk``
    hook) without joining its process-wide list of instances, which a process holding several
    models (learner, reference, engine) would mix up."""

    def __init__(self, replay: "RoutingReplay", index: int):
        self.replay = replay
        self.index = index  # among the replay's layers (this stage's)
        self.target: Optional[torch.Tensor] = None
        # Targets of forwards whose recompute (activation checkpointing) is still to come, in
        # forward order: 1F1B recomputes micro-batches in the order it ran them.
        self.pending: List[torch.Tensor] = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self._target_for_this_forward()
        if target is None:
            return own_values, own
        target = target.to(device=scores.device, dtype=torch.long)
        if target.shape != own.shape:
            raise ValueError(f"routing replay: {tuple(target.shape)} recorded choices for a forward routing "
                             f"{tuple(own.shape)} (tokens, top-k): the recorded routing does not match the batch")
        known = target[:, :1] >= 0
        self.replay.count_agreement(own, target, known)
        if not self.replay.enforce:
            self.replay.count_load(self.index, own, known)
            return own_values, own
        chosen = torch.where(known, target, own)
        self.replay.count_load(self.index, chosen, known)
        return scores.gather(1, chosen), chosen

    def _target_for_this_forward(self) -> Optional[torch.Tensor]:
        if not self.replay.recompute:
            return self.target
        # Under full activation recompute the first forward runs inside checkpointing with
        # autograd off and the recompute (in the backward) with it on.
        if torch.is_grad_enabled() and self.pending:
            return self.pending.pop(0)
        if self.target is not None and not torch.is_grad_enabled():
            self.pending.append(self.target)
        return self.target


class RoutingReplay:
    """Replays recorded choices in a model's routers (``enforce``) or only compares them with
    the routers' own (``enforce=False``); either way counts agreement. A context manager:
    attaches to the routers on entry, detaches on exit.

        with RoutingReplay(model, enforce=True) as replay:
            replay.set(choices)      # before each micro-batch's forward: [layers, tokens, top_k]
            ...
            agree, total = replay.agreement()
    """

    def __init__(self, model: torch.nn.Module, enforce: bool = True):
        self.layers = moe_layers(model)
        self.enforce = enforce
        config = self.layers[0].config if self.layers else None
        self.recompute = bool(config is not None and config.recompute_granularity == "full")
        self._agree: Optional[torch.Tensor] = None
        self._total: Optional[torch.Tensor] = None
        # Tokens each expert of each layer received among the recorded ones: [layers, experts].
        self._load: Optional[torch.Tensor] = None
        self._hooks: List[_LayerReplay] = []

    def __enter__(self) -> "RoutingReplay":
        for index, layer in enumerate(self.layers):
            hook = _LayerReplay(self, index)
            layer.router.router_replay = hook
            self._hooks.append(hook)
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            layer.router.router_replay = None
        self._hooks = []

    def set(self, choices: Optional[torch.Tensor]) -> None:
        """The choices for the next forward: [this stage's MoE layers, tokens, top_k], or
        [all MoE layers, ...] (this stage's rows are picked by ``moe_index``); None routes freely."""
        if choices is not None and self.layers and choices.size(0) != len(self.layers):
            choices = choices[[layer.moe_index for layer in self.layers]]
        for i, hook in enumerate(self._hooks):
            hook.target = None if choices is None else _as_signed(choices[i])

    def count_agreement(self, own: torch.Tensor, target: torch.Tensor, known: torch.Tensor) -> None:
        # A choice agrees when the router's own top-k holds the recorded expert (order-free).
        same = (own.unsqueeze(2) == target.unsqueeze(1)).any(dim=2) & known
        agree = same.sum(dtype=torch.int64)
        total = known.sum(dtype=torch.int64) * own.size(1)
        self._agree = agree if self._agree is None else self._agree + agree
        self._total = total if self._total is None else self._total + total

    def count_load(self, index: int, chosen: torch.Tensor, known: torch.Tensor) -> None:
        # A scatter into a fixed-size tensor: no host synchronisation (bincount would need one).
        if self._load is None:
            experts = self.layers[0].config.num_moe_experts
            self._load = torch.zeros(len(self.layers), experts, dtype=torch.float64, device=chosen.device)
        weight = known.expand_as(chosen).to(torch.float64).reshape(-1)
        self._load[index].scatter_add_(0, chosen.reshape(-1), weight)

    def expert_load(self) -> Optional[torch.Tensor]:
        """[this stage's MoE layers, experts]: how many recorded tokens each expert received
        (the experts the forwards used: the recorded ones when enforcing) since entry; None
        before any recorded token."""
        return self._load

    def agreement(self) -> Tuple[int, int]:
        """(choices where the router's own top-k holds the recorded expert, recorded choices)
        over the forwards since entry (one host read)."""
        if self._total is None:
            return 0, 0
        return int(self._agree), int(self._total)


def _as_signed(choices: torch.Tensor) -> torch.Tensor:
    """uint8 ids with 255 for "unrecorded" as int64 with -1."""
    if choices.dtype == torch.uint8:
        wide = choices.to(torch.int64)
        return torch.where(wide == 255, UNRECORDED, wide)
    return choices.to(torch.int64)


@contextlib.contextmanager
def routing_replay(model: torch.nn.Module, enforce: bool = True) -> Iterator[RoutingReplay]:
    """``RoutingReplay`` as a function-style context manager."""
    with RoutingReplay(model, enforce) as replay:
        yield replay


def routing_replay_on(cfg) -> bool:
    """Whether the learner replays the rollout engine's MoE routing (``algo.routing_replay``,
    with auto resolved: on for an MoE model with the embedded engine recording its routing)."""
    mode, m = cfg.algo.routing_replay, cfg.model
    if mode == "auto":
        return (m.num_experts > 0 and m.moe_grouped_experts and cfg.rollout.engine == "embedded"
                and cfg.rollout.record_routing)
    return mode == "rollout"


def check_routing_replay(cfg) -> None:
    """algo.routing_replay=rollout needs routing to replay: an MoE model whose layers record and
    replay it, and an engine that returns it."""
    if cfg.algo.routing_replay != "rollout":
        return
    m = cfg.model
    if m.num_experts == 0:
        raise ConfigError("algo.routing_replay=rollout needs a mixture-of-experts model (model.num_experts > 0): "
                          "a dense model has no routing to replay; use algo.routing_replay=auto or none")
    if not m.moe_grouped_experts:
        raise ConfigError("algo.routing_replay=rollout needs model.moe_grouped_experts=true: routing is recorded "
                          "and replayed in the grouped MoE layers; set it, or algo.routing_replay=none")
    if cfg.rollout.engine == "vllm":
        raise ConfigError("algo.routing_replay=rollout with rollout.engine=vllm: the vLLM engine does not return "
                          "the experts it routed each token to; use rollout.engine=embedded, or "
                          "algo.routing_replay=none (or auto)")
    if not cfg.rollout.record_routing:
        raise ConfigError("algo.routing_replay=rollout with rollout.record_routing=false: the engine records no "
                          "routing to replay; set rollout.record_routing=true, or algo.routing_replay=none")
