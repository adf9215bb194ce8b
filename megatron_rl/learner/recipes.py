"""Learner recipes: what one algorithm does with a step's batch on the learner ranks, chosen by
``algo.name`` from ``LEARNER_RECIPES``.

A recipe declares the extra model it trains (``critic``; the frozen reference model comes with
``algo.kl_coef`` > 0 for every recipe), fills the batch's fields before the update (the rewards
it trains on, values, advantages: learner/train_batch.py, each written once), and runs what
follows the policy update (the critic's own). The policy update itself is the learner's, with
``algo.policy_loss`` and the rollout corrections. Adding an algorithm is one recipe registered
here (or from a plugin) and its test.

Shared by every recipe: the rewards the step trains on are the verifier's, or with
``algo.kl_in_reward`` the verifier's minus kl_coef · Σ_t KL(policy ‖ reference) per sequence
(the proximal and reference logprobs that takes go into the batch, so the update does not
compute them again).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from ..algorithms.advantages import ADVANTAGE_ESTIMATORS, row_advantages
from ..algorithms.kl import kl_shaped_reward
from ..registry import Registry
from ..algorithms.gae import gae_advantages, masked_whiten
from .teachers import teacher_logprobs
from .data_parallel import gather_rows, sum_over_replicas
from .shares import BatchIndex
from .train_batch import TrainBatch, padded
from ..algorithms.rollout_correction import Correction
from ..errors import ConfigError


class LearnerWorker(Protocol):
    """What a recipe uses of the learner worker (learner/worker.py) that runs it: its config, its
    policy learner and its critic (None without one). Spelled here so that recipes, which the
    learner reads, do not import the worker that imports the learner."""

    cfg: Any
    learner: Any
    critic: Optional[Any]

Metrics = Dict[str, float]


class LearnerRecipe:
    """Group-relative advantages (``algo.name`` one of the advantage estimators)."""

    # Whether the recipe trains a value model next to the policy (learner/critic.py).
    critic = False
    # Whether the recipe needs a frozen teacher (teacher.path).
    teacher = False
    # Whether its samples are the dataset rows' own responses instead of the engine's (SFT).
    samples_from_data = False
    # The per-token loss it trains with (a POLICY_LOSSES name); None: algo.policy_loss.
    policy_loss: Optional[str] = None
    # Whether its advantages compare samples within a group (algo.group_size >= 2).
    group_relative = True

    def prepare(self, worker: "LearnerWorker", batch: TrainBatch) -> Tuple[TrainBatch, Metrics]:
        """The batch with every field the update needs, and metrics of this preparation."""
        batch, metrics = trained_rewards(worker, batch)
        return with_group_advantages(worker, batch), metrics

    def after_update(self, worker: "LearnerWorker", batch: TrainBatch, lr: float) -> Metrics:
        """What runs after the policy's update (nothing here)."""
        return {}


class CriticRecipe(LearnerRecipe):
    """PPO with a critic: per-token GAE advantages from a Megatron value model with the policy's
    layout (its values before its update), which then regresses on the GAE returns."""

    critic = True

    def prepare(self, worker: "LearnerWorker", batch: TrainBatch) -> Tuple[TrainBatch, Metrics]:
        batch, metrics = trained_rewards(worker, batch)
        batch = batch.with_fields(values=worker.critic.compute_values(batch))
        a = worker.cfg.algo
        advantages, returns = gae_advantages_and_returns(batch, a.gamma, a.lam, a.gae_whiten)
        return batch.with_fields(advantages=advantages, returns=returns), metrics

    def after_update(self, worker: "LearnerWorker", batch: TrainBatch, lr: float) -> Metrics:
        return worker.critic.train_step(batch, lr / worker.cfg.learner.lr)


class DistillationRecipe(LearnerRecipe):
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): the student
    samples, a frozen teacher (``teacher.path``, or per row the one of ``teacher.paths`` its
    ``teacher.field`` names: learner/teachers.py) scores the student's tokens, and each token's
    advantage is log π_teacher(y_t) - log π_student(y_t), the negative per-token reverse KL, so
    the policy-gradient step lowers KL(π_student ‖ π_teacher) on the states the student visits.
    ``teacher.reward_weight`` > 0 adds that weight times the reward's group advantage."""

    teacher = True

    def prepare(self, worker: "LearnerWorker", batch: TrainBatch) -> Tuple[TrainBatch, Metrics]:
        batch, metrics = trained_rewards(worker, batch)
        learner, temperature = worker.learner, worker.cfg.rollout.temperature
        if not batch.has("proximal_logprobs"):
            batch = batch.with_fields(proximal_logprobs=learner.compute_logprobs(batch, temperature))
        student = batch.get("proximal_logprobs")
        teacher = teacher_logprobs(batch, lambda trajs, name: learner.compute_logprobs(trajs, temperature,
                                                                                         teacher=name))
        advantages = [[t - s for t, s in zip(t_row, s_row)] for t_row, s_row in zip(teacher, student)]
        weight = worker.cfg.teacher.reward_weight
        if weight:
            grouped = with_group_advantages(worker, batch).get("advantages")
            advantages = [[a + weight * g for a, g in zip(row, g_row)] for row, g_row in zip(advantages, grouped)]
        metrics.update(reverse_kl_metrics(batch, student, teacher))
        return batch.with_fields(advantages=advantages), metrics


def reverse_kl_metrics(batch: TrainBatch, student: Sequence[Sequence[float]],
                       teacher: Sequence[Sequence[float]]) -> Metrics:
    """``distill/reverse_kl``: the sampled-token estimate of KL(π_student ‖ π_teacher) per
    trained token; with several teachers also ``distill/reverse_kl/<name>`` over each one's rows."""
    names = batch.teachers or ("",) * len(batch)
    sums: Dict[str, List[float]] = {}
    if batch.teachers:  # every teacher of the step, so the sums over the replicas have the same keys
        sums = {name: [0.0, 0.0] for name in sorted(set(index_of(batch).teachers))}
    for traj, name, s_row, t_row in zip(batch, names, student, teacher):
        kl, tokens = sums.setdefault(name, [0.0, 0.0])
        sums[name] = [kl + sum((s - t) * m for s, t, m in zip(s_row, t_row, traj.loss_mask)),
                      tokens + sum(traj.loss_mask)]
    if not whole(batch):  # a replica's share: the step's sums are the replicas' together
        summed = sum_over_replicas({f"{k}/{part}": v[i] for k, v in sums.items() for i, part in enumerate(("kl", "n"))})
        sums = {k: [summed[f"{k}/kl"], summed[f"{k}/n"]] for k in sums}
    kl_total, tokens_total = (sum(v[i] for v in sums.values()) for i in (0, 1))
    metrics = {"distill/reverse_kl": kl_total / tokens_total if tokens_total else 0.0}
    if batch.teachers:
        metrics.update({f"distill/reverse_kl/{name}": kl / tokens if tokens else 0.0
                        for name, (kl, tokens) in sums.items()})
    return metrics


class SupervisedRecipe(LearnerRecipe):
    """Supervised fine-tuning: the rows' own responses (rollout/dataset_responses.py) trained with
    the response-token negative log-likelihood (``nll``); every token's weight is 1."""

    samples_from_data = True
    policy_loss = "nll"
    group_relative = False

    def prepare(self, worker: "LearnerWorker", batch: TrainBatch) -> Tuple[TrainBatch, Metrics]:
        return batch.with_fields(rewards=[0.0] * len(batch),
                                 advantages=[[1.0] * len(t.response_ids) for t in batch]), {}


LEARNER_RECIPES: Registry[LearnerRecipe] = Registry("learner recipe")
LEARNER_RECIPES.register("gae")(CriticRecipe())
LEARNER_RECIPES.register("opd")(DistillationRecipe())
LEARNER_RECIPES.register("sft")(SupervisedRecipe())


def recipe_for(algo_name: str) -> LearnerRecipe:
    """The recipe of ``algo.name``: its own, or the group-advantage one for an estimator."""
    if algo_name in LEARNER_RECIPES:
        return LEARNER_RECIPES.get(algo_name)
    if algo_name in ADVANTAGE_ESTIMATORS:
        return LearnerRecipe()
    raise ValueError(f"algo.name={algo_name!r}: no learner recipe or advantage estimator of that name "
                     f"(recipes: {LEARNER_RECIPES.names()}, estimators: {ADVANTAGE_ESTIMATORS.names()})")


def index_of(batch: TrainBatch) -> BatchIndex:
    """What every rank knows of every row of the step's batch (built here for a batch made
    without one, e.g. in a test)."""
    return batch.index if batch.index is not None else BatchIndex.of(batch, batch.groups, batch.teachers)


def whole(batch: TrainBatch) -> bool:
    """Whether this rank holds every row of the step (else batch-wide figures need the replicas)."""
    return not batch.local or index_of(batch).whole


def every_row(batch: TrainBatch, values: Sequence) -> List:
    """One value per row of the whole step, on every rank, from this batch's ``values`` (one per
    trajectory): a share's come from every replica (a few bytes per row)."""
    index = index_of(batch)
    if not batch.local:
        return list(values)
    return gather_rows(index.rows, values, len(index))


def trained_rewards(worker: "LearnerWorker", batch: TrainBatch) -> Tuple[TrainBatch, Metrics]:
    """The batch with ``rewards``: the verifier's, or KL-charged with ``algo.kl_in_reward``."""
    a = worker.cfg.algo
    verifier = [t.reward for t in batch]
    if not a.kl_in_reward:
        return batch.with_fields(rewards=verifier), {}
    temperature = worker.cfg.rollout.temperature
    learner = worker.learner
    batch = batch.with_fields(proximal_logprobs=learner.compute_logprobs(batch, temperature),
                              ref_logprobs=learner.compute_logprobs(batch, temperature, reference=True))
    shaped = [kl_shaped_reward(r, torch.tensor(p), torch.tensor(ref), a.kl_coef, a.kl_estimator)
              for r, p, ref in zip(verifier, batch.get("proximal_logprobs"), batch.get("ref_logprobs"))]
    charges = every_row(batch, [r - s for r, s in zip(verifier, shaped)])
    charge = float(np.mean(charges)) if charges else 0.0
    return batch.with_fields(rewards=shaped), {"reward/kl_penalty_mean": charge}


def with_group_advantages(worker: "LearnerWorker", batch: TrainBatch) -> TrainBatch:
    """The batch with per-token ``advantages``: each sample's group-relative advantage on
    every one of its response tokens."""
    index = index_of(batch)
    rewards = every_row(batch, batch.get("rewards"))  # a group's rows may be on several replicas
    advantage = row_advantages(index.groups, index.sample_index, index.trained_tokens, index.advantage_scale,
                               rewards, worker.cfg.algo)
    rows = index.rows if batch.local else range(len(batch))
    return batch.with_fields(advantages=[[advantage[r]] * len(t.response_ids) for r, t in zip(rows, batch)])


def gae_advantages_and_returns(batch: TrainBatch, gamma: float, lam: float, whiten: bool = True,
                               ) -> Tuple[List[List[float]], List[List[float]]]:
    """Per-token GAE advantages and critic returns of each trajectory, from the batch's values
    (the critic's, before its update) and rewards; the outcome reward arrives at the last
    response token. Advantages are whitened over the batch's trained tokens (PPO's usual
    normalisation) when ``whiten``."""
    lengths = [len(t.response_ids) for t in batch]
    valid = padded(batch, [[1.0] * n for n in lengths])
    at_last = padded(batch, [[0.0] * (n - 1) + [r] if n else [] for n, r in zip(lengths, batch.get("rewards"))])
    advantages, returns = gae_advantages(at_last, padded(batch, batch.get("values")), valid, gamma, lam)
    if whiten:
        mask = padded(batch, [t.loss_mask for t in batch])
        advantages = masked_whiten(advantages, mask) if whole(batch) else whiten_over_replicas(advantages, mask)
    return ([advantages[i, :n].tolist() for i, n in enumerate(lengths)],
            [returns[i, :n].tolist() for i, n in enumerate(lengths)])


def whiten_over_replicas(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` with the mean and variance of the whole step's masked entries, from the
    replicas' sums (each holds its share's rows)."""
    mask = mask.to(values.dtype)
    first = sum_over_replicas({"count": float(mask.sum()), "sum": float((values * mask).sum())})
    if first["count"] == 0:
        return torch.zeros_like(values)
    mean = first["sum"] / first["count"]
    var = sum_over_replicas({"sq": float((((values - mean) * mask) ** 2).sum())})["sq"] / first["count"]
    return (values - mean) / (var ** 0.5 + eps) * mask


def check_group_size(cfg) -> None:
    """algo.group_size (and correction.*) against what the learner recipe samples."""
    recipe = recipe_for(cfg.algo.name)
    if recipe.samples_from_data:
        if cfg.algo.group_size != 1:
            raise ConfigError(f"algo.name={cfg.algo.name} trains on each row's own response once: set "
                              f"algo.group_size=1 (it is {cfg.algo.group_size})")
        if Correction(**dataclasses.asdict(cfg.correction)).active:
            raise ConfigError(f"correction.* weighs sampled tokens by the engine's logprobs, and algo.name="
                              f"{cfg.algo.name} samples nothing: leave the correction keys at their defaults")
    elif recipe.group_relative and cfg.algo.group_size < 2:
        raise ConfigError(
            f"algo.group_size={cfg.algo.group_size} must be >= 2: group-relative advantages "
            "need at least two samples per prompt"
        )


def check_teacher(cfg) -> None:
    """A teacher (teacher.path) or named teachers routed by a row field (teacher.paths,
    teacher.field, teacher.default) exactly when the learner recipe distils."""
    t = cfg.teacher
    wants = recipe_for(cfg.algo.name).teacher
    if wants and not (t.path or t.paths):
        raise ConfigError(f"algo.name={cfg.algo.name} distils from a teacher: set teacher.path=<a Hugging Face or "
                          "Megatron checkpoint with the student's tokenizer>, or teacher.paths and teacher.field "
                          "for one teacher per kind of row")
    if not wants:
        for key in ("path", "paths", "field", "default"):
            if getattr(t, key):
                raise ConfigError(f"teacher.{key}={getattr(t, key)!r} is only read by on-policy distillation: set "
                                  f"algo.name=opd, or drop teacher.{key}")
        return
    if t.path and t.paths:
        raise ConfigError("teacher.path and teacher.paths are both set: give one teacher as teacher.path, or every "
                          "teacher (the default one too) in teacher.paths with teacher.default naming it")
    if t.paths and not t.field:
        raise ConfigError(f"teacher.paths names {len(t.paths)} teachers but not which row gets which: set "
                          "teacher.field to the dataset row field holding a teacher's name (e.g. data_source)")
    if (t.field or t.default) and not t.paths:
        key = "field" if t.field else "default"
        raise ConfigError(f"teacher.{key} chooses among named teachers: set teacher.paths={{name: checkpoint, ...}}, "
                          f"or drop teacher.{key} for the one teacher of teacher.path")
    if t.default is not None and t.default not in t.paths:
        raise ConfigError(f"teacher.default={t.default!r} is not a teacher of teacher.paths (names: "
                          f"{', '.join(sorted(t.paths))})")
    checkpoints = {f"teacher.paths.{name}": path for name, path in t.paths.items()} if t.paths else \
        {"teacher.path": t.path}
    for key, path in checkpoints.items():
        if not path or not Path(path).is_dir():
            raise ConfigError(f"{key}={path!r} is not a directory (a Hugging Face or Megatron checkpoint)")
