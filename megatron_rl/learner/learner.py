"""The Megatron learner: model + optimizer, logprob forward, policy-gradient train step, HF export.

Forward and backward go through Megatron's pipeline schedules (``get_forward_backward_func``),
so the same code runs at PP=1 and PP>1. Losses are token sums; Megatron divides gradients by the
global token count (``calculate_per_token_loss``), which makes the loss a token mean over the
whole batch across micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..algorithms import kl_penalty
from ..algorithms.policy_loss import POLICY_LOSSES, aggregate_loss
from ..algorithms.rollout_correction import Correction, rollout_correction
from ..config.schema import RootConfig
from ..errors import ConfigError
from ..models.gpt import build_gpt_model, model_device
from ..models.grouped_moe import stack_expert_parameters
from ..models.lora import adapters_disabled, add_lora, dropout_disabled
from ..models.pretrained import load_pretrained
from ..models.routing import RoutingReplay, foreign_moe_layers, routing_replay_on
from ..models.shared_prefix import rotary_at
from ..types import Trajectory
from .batch import MicroBatch
from .train_batch import TrainBatch
from .logprobs import token_logprobs, token_logprobs_and_entropy
from .teachers import build_teachers
from .megatron_step import (finite_mean, local_micro_batches, minibatch_steps, optimizer_step, per_token_outputs,
                            set_lr, weights_finite, wrap_for_training)
from .parallel import init_model_parallel
from .routing_stats import RoutingStats

logger = logging.getLogger(__name__)

def forward_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V_local] of a GPTModel for right-padded token ids [b, s].

    No mask is passed: the layer specs' mask type is causal, which TransformerEngine and the
    local spec's attention (models/causal_attention.py: a fused kernel) then apply themselves."""
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, position_ids, None)


def forward_micro_batch(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Logits [b, s, V_local] of a micro-batch's rows; with ``learner.share_prompts`` computed by
    one row per group (models/shared_prefix.py) and gathered into the rows' layout."""
    if mb.shared is None:
        return forward_logits(model, mb.tokens)
    shared = mb.shared
    with rotary_at(model, shared.positions):
        logits = model(shared.tokens, shared.positions, shared.layout)
    return shared.gather(logits)


class Learner:
    """Policy model, optional frozen reference and teachers, Megatron optimizer."""

    def __init__(self, cfg: RootConfig, vocab_size: int, pad_id: int = 0):
        self.cfg = cfg
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        lc = cfg.learner
        init_model_parallel(lc.tp, lc.pp, lc.ep, lc.cp, seed=cfg.trainer.seed)
        self.device = model_device()
        if lc.share_prompts and self.device.type == "cuda":
            # TransformerEngine's attention takes masks, not segments; without it, SDPA with a
            # segment mask has no flash kernel on CUDA: one H200, Qwen2-1.5B shape, 256 samples,
            # 2.7-3.4 s per step on plain rows vs 8.4-10.2 s shared (prompts of 60-128 tokens),
            # 10.4-12.2 vs 20-21 s (prompts of 1-2k).
            raise ConfigError("learner.share_prompts=true is for CPU learners for now: on a GPU its "
                              "segment attention has no flash kernel and trains 2-3x slower than plain "
                              "rows (measured on an H200); set learner.share_prompts=false")
        model = build_gpt_model(cfg.model, vocab_size, tp=lc.tp, pp=lc.pp, ep=lc.ep,
                                recompute=lc.recompute_activations)
        if cfg.model.path:  # start from a Hugging Face or Megatron checkpoint (models/pretrained.py)
            load_pretrained(model, cfg.model, cfg.model.path)
        # LoRA: the loaded base is frozen and only the adapters train (models/lora.py); added
        # before the wrap, so megatron's gradient buffers and optimizer see the adapters only.
        self.lora = cfg.lora.rank > 0
        if self.lora:
            try:
                add_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets,
                         seed=cfg.trainer.seed)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        self.model, self.optimizer = wrap_for_training(model, lc, cfg.model.dtype == "bf16", lc.lr)
        self.ref_model: Optional[torch.nn.Module] = None
        # The KL penalty's reference: the initial policy. Under LoRA that is the base itself, run
        # by the policy's model with its adapters off (no second copy of the weights).
        self.has_reference = cfg.algo.kl_coef > 0
        if self.has_reference and not self.lora:
            self.ref_model = build_gpt_model(cfg.model, vocab_size, tp=lc.tp, pp=lc.pp, ep=lc.ep)
            stack_expert_parameters(self.ref_model)
            self.ref_model.load_state_dict(self.module.state_dict())
            self.ref_model.requires_grad_(False).eval()
        # On-policy distillation: the frozen teachers by name (learner/teachers.py), each its own
        # architecture with the learner's layout.
        self.teachers: Dict[str, torch.nn.Module] = build_teachers(cfg, vocab_size)
        self.optimizer_steps = 0
        self.skipped_in_a_row = 0
        self.correction = Correction(**dataclasses.asdict(cfg.correction))
        from .recipes import recipe_for

        recipe = recipe_for(cfg.algo.name)
        # The learner recipe's own loss (SFT's nll) or algo.policy_loss.
        self.policy_loss = recipe.policy_loss or cfg.algo.policy_loss
        # Whether the samples are the engine's (with its logprobs), not a dataset's own responses
        # (SFT: no behaviour logprobs to compare, no ratio, so no proximal pass either).
        self.engine_samples = not recipe.samples_from_data
        # The policy version being trained (train_step's ``version``): what correction.max_version_gap
        # measures each token's age against.
        self._version: Optional[int] = None
        # Tests set this to compare the skipped proximal forward with the explicit one.
        self.force_proximal_forward = False
        self._proximal_in_forward = False
        # Mixture of experts: the forwards of a sample route its tokens as the engine did
        # (``algo.routing_replay``), or only compare with it; dense models skip all of it.
        self.moe = cfg.model.num_experts > 0
        self.replay_routing = routing_replay_on(cfg) and self._replayable()
        self.routing_stats = RoutingStats(self.module.config) if self.moe else None
        self._replay: Optional[RoutingReplay] = None

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel under the DDP wrapper."""
        return self.model.module

    def _replayable(self) -> bool:
        """Whether this stage's MoE layers can replay routing; refuses an explicit
        algo.routing_replay=rollout where they cannot, and turns auto off with a warning."""
        foreign = foreign_moe_layers(self.module)
        if not foreign:
            return True
        why = (f"{foreign} MoE layers of this learner are megatron-core's own (SequentialMLP or TransformerEngine's "
               "grouped MLP), which cannot replay routing")
        if self.cfg.algo.routing_replay == "rollout":
            raise ConfigError(f"algo.routing_replay=rollout: {why}; use the local layer spec with "
                              "model.moe_grouped_experts=true, or algo.routing_replay=none")
        logger.warning("routing replay off: %s", why)
        return False

    # ---------------------------------------------------------------- forward only
    @torch.no_grad()
    def compute_logprobs(self, trajs: Sequence[Trajectory], temperature: float,
                         reference: bool = False, teacher: Union[bool, str] = False) -> List[List[float]]:
        """Per-response-token logprobs of each trajectory under the current weights, the
        reference's or a teacher's (``teacher``: its name, or True for the only one)."""
        if teacher:
            model = self._teacher(teacher)
            # Another network than the one that sampled: it routes by its own routers.
            return per_token_outputs(model, trajs, self.cfg.learner, self.pad_id,
                                     partial(self._forward_step, temperature=temperature))
        if reference and not self.has_reference:
            raise RuntimeError("no reference model: set algo.kl_coef > 0 to build one")
        model = self.ref_model if reference and not self.lora else self.model
        # Under LoRA: the reference is the base (adapters off); no pass here applies adapter dropout.
        base_only = adapters_disabled(self.module) if reference and self.lora else contextlib.nullcontext()
        # The policy's forward before an update is the proximal pass: its routers' agreement with
        # the engine is the step's moe/router_agreement.
        with self._routing(model, count=not reference), base_only, dropout_disabled(self.module):
            return per_token_outputs(model, trajs, self.cfg.learner, self.pad_id,
                                     partial(self._forward_step, temperature=temperature))

    def _teacher(self, name: Union[bool, str]) -> torch.nn.Module:
        if name is True:
            if len(self.teachers) != 1:
                raise RuntimeError(f"{len(self.teachers)} teachers ({sorted(self.teachers)}): name the one to use")
            return next(iter(self.teachers.values()))
        if name not in self.teachers:
            raise RuntimeError(f"no teacher {name!r} (teachers: {sorted(self.teachers) or 'none; set teacher.path'})")
        return self.teachers[name]

    @contextlib.contextmanager
    def _routing(self, model: torch.nn.Module, count: bool) -> Iterator[None]:
        """During the block, each micro-batch's forward replays (or, without routing replay, only
        compares with) the routing its trajectories recorded (``MicroBatch.routing``); with
        ``count``, the routers' agreement and the experts' load go into ``routing_stats``."""
        if not self.moe:
            yield
            return
        with RoutingReplay(model, enforce=self.replay_routing) as replay:
            self._replay = replay
            try:
                yield
            finally:
                self._replay = None
            if count:
                self.routing_stats.add(replay)

    def _route_as_recorded(self, mb: MicroBatch) -> None:
        """Hand the micro-batch's recorded routing to the routers: called inside the forward-step
        function, so under a pipeline schedule each micro-batch's forward gets its own."""
        if self._replay is not None:
            self._replay.set(mb.routing)

    def _forward_step(self, data_iterator, model, temperature: float):
        mb: MicroBatch = next(data_iterator).to(self.device)
        self._route_as_recorded(mb)
        logits = forward_micro_batch(model, mb)

        def collect(output, non_loss_data=True):
            return token_logprobs(output, mb.labels, temperature) * mb.loss_mask

        return logits, collect

    # ---------------------------------------------------------------- training
    def train_step(self, batch: TrainBatch, temperature: float, lr: float,
                   version: Optional[int] = None) -> Dict[str, float]:
        """PPO epochs × mini-batches of optimizer steps over one batch, which must carry
        advantages; the proximal (and reference) logprobs it lacks are computed here.
        ``version``: the policy version of the weights being trained (needed by
        correction.max_version_gap)."""
        cfg = self.cfg
        if self.correction.max_version_gap > 0 and version is None:
            raise ValueError("correction.max_version_gap needs the trained policy version")
        self._version = version
        # One optimizer step per batch: the weights before the update are the ones the training
        # forward runs with, so the proximal logprobs are that forward's own (detached) and the
        # separate forward pass over the batch is skipped.
        # (Not with LoRA dropout: the training forward drops adapter inputs, the proximal policy does not.)
        self._proximal_in_forward = (cfg.learner.mini_batches == 1 and cfg.learner.ppo_epochs == 1
                                     and not self.force_proximal_forward and not (self.lora and cfg.lora.dropout > 0))
        if not self._proximal_in_forward and not batch.has("proximal_logprobs") and self.engine_samples:
            batch = batch.with_fields(proximal_logprobs=self.compute_logprobs(batch, temperature))
        if self.has_reference and not batch.has("ref_logprobs"):
            batch = batch.with_fields(ref_logprobs=self.compute_logprobs(batch, temperature, reference=True))
        set_lr(self.optimizer, lr)
        totals, grad_norms = minibatch_steps(batch, cfg.learner, partial(self._optimizer_step, temperature=temperature))
        tokens = max(totals.pop("tokens", 0.0), 1.0)
        skipped = totals.pop("skipped_steps", 0.0)
        metrics = {f"train/{k.removesuffix('_sum')}": v / tokens for k, v in totals.items()}
        # Steps skipped for a non-finite loss or gradient norm, in this batch and in a row (the
        # trainer stops at learner.max_skipped_steps in a row).
        metrics["train/skipped_steps"] = skipped
        metrics["train/skipped_in_a_row"] = float(self.skipped_in_a_row)
        metrics["train/clip_fraction"] = metrics.pop("train/clipped_tokens")
        if "train/capped_tokens" in metrics:
            metrics["train/capped_fraction"] = metrics.pop("train/capped_tokens")
        if self.correction.active:  # fractions of the trained tokens; the weight is a mean over the kept ones
            for name in ("rejected", "vetoed", "version_dropped", "kept"):
                if f"train/{name}_tokens" in metrics:
                    metrics[f"correction/{name}_fraction"] = metrics.pop(f"train/{name}_tokens")
            kept = totals.get("kept_tokens", 0.0)
            metrics["correction/is_weight_mean"] = totals["is_weight_sum"] / kept if kept else float("nan")
            del metrics["train/is_weight"]
        metrics["train/grad_norm"] = finite_mean(grad_norms)
        metrics["train/lr"] = lr
        if self.routing_stats is not None:  # collective over the stages and replicas: every rank
            metrics.update(self.routing_stats.pop_metrics())
        return metrics

    def _optimizer_step(self, batch: TrainBatch, temperature: float) -> Tuple[Dict[str, float], float]:
        # Without a separate proximal pass this forward is the proximal one (the weights before the update).
        with self._routing(self.model, count=self._proximal_in_forward):
            stats, grad_norm = optimizer_step(self.model, self.optimizer,
                                              local_micro_batches(batch, self.cfg.learner, self.pad_id),
                                              partial(self._loss_step, temperature=temperature))
        self.optimizer_steps += 1
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if stats["skipped_steps"] else 0
        return stats, grad_norm

    def _loss_step(self, data_iterator, model, temperature: float):
        mb: MicroBatch = next(data_iterator).to(self.device)
        self._route_as_recorded(mb)
        logits = forward_micro_batch(model, mb)
        return logits, partial(self._policy_loss, mb=mb, temperature=temperature)

    def _policy_loss(self, logits: torch.Tensor, mb: MicroBatch, temperature: float):
        algo = self.cfg.algo
        mask = mb.loss_mask
        logprobs, entropy = token_logprobs_and_entropy(logits, mb.labels, temperature)
        proximal = logprobs.detach() * mask if self._proximal_in_forward else mb.proximal_logprobs
        # Rollout correction: ``train`` is the mask without the tokens it leaves out and ``weight``
        # each token's importance weight (off: the mask itself, no weight).
        train, weight, correction_stats = mask, None, {}
        if self.correction.active:
            lag = (self._version - mb.versions) if self._version is not None else None
            weight, train, correction_stats = rollout_correction(proximal, mb.behav_logprobs, mask, self.correction,
                                                                 lag)
        loss, stats = POLICY_LOSSES.get(self.policy_loss)(logprobs, proximal, mb.behav_logprobs, mb.advantages, train,
                                                          algo)
        if weight is not None and self.correction.is_level != "none":
            loss = loss * weight
        stats.update(correction_stats)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * entropy * train
        if self.has_reference:
            kl = kl_penalty(logprobs, mb.ref_logprobs, algo.kl_estimator) * train
            if not algo.kl_in_reward:  # otherwise the trainer already charged it to the reward
                loss = loss + algo.kl_coef * kl
            stats["kl_sum"] = kl.detach().sum()
        num_tokens = mask.sum()
        total = loss.sum()
        # What the optimizer step averages over (Megatron divides by the summed denominators).
        objective, denominator = aggregate_loss(loss, train, algo.loss_agg_mode, self.cfg.rollout.max_new_tokens)
        stats.update(loss_sum=total.detach(), entropy_sum=(entropy.detach() * mask).sum(), tokens=num_tokens.detach())
        if self.engine_samples:
            # |learner - engine| logprob gap on the sampled tokens: should be ~0 on-policy.
            stats["behav_logprob_gap_sum"] = ((proximal - mb.behav_logprobs).abs() * mask).sum()
        return objective, denominator.round().to(torch.int), stats

    # ---------------------------------------------------------------- weights out
    def weights_finite(self) -> bool:
        """Whether every weight of the policy on every learner rank is finite (collective)."""
        return weights_finite(self.model)

    def export_hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Every full tensor of the policy under Hugging Face names, on every learner rank
        (``weights/export.py``, the one export: gathered over TP/EP, exchanged over PP; under
        LoRA the adapted weights merged, W + s·B·A in fp32 cast to the model's dtype, what
        engines without LoRA support load). Collective over the learner ranks when sharded."""
        from ..weights.export import all_hf_tensors

        return all_hf_tensors(self.module, self.cfg.model)

    def adapter_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """This pipeline stage's LoRA adapters as full tensors (gathered over tensor parallelism)
        under full-model Megatron names with global layer numbers, e.g.
        ``decoder.layers.3.self_attention.linear_qkv.lora_b``; nothing without LoRA. Collective
        over the tensor-parallel group."""
        from ..weights.reshard import full_tensors

        return full_tensors(self.module, adapters_only=True)
