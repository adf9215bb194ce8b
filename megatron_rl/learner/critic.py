"""PPO's critic: a Megatron value model trained next to the policy, with the policy's parallel
layout, micro-batching and pipeline schedules, and its own optimizer.

Values are per response token, at the same positions as the policy's logprobs: the value at
position p-1+t is V(prompt + response[:t]), the state in which response token t is chosen.

An MoE critic routes by its own router, without routing replay: replay makes the learner score
tokens with the network that sampled them, and the critic is a different network, which no
engine forward ran."""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..algorithms.gae import clipped_value_loss, explained_variance
from ..config.schema import RootConfig
from ..models.gpt import model_device
from ..models.value_model import build_value_model
from ..types import Trajectory
from .batch import MicroBatch
from .data_parallel import sum_over_replicas
from .train_batch import TrainBatch, padded
from .learner import forward_micro_batch
from .parallel import init_model_parallel
from .megatron_step import (finite_mean, local_micro_batches, minibatch_steps, optimizer_step, per_token_outputs,
                            set_lr, wrap_for_training)


class Critic:
    def __init__(self, cfg: RootConfig, vocab_size: int, pad_id: int = 0,
                 policy: Optional[torch.nn.Module] = None):
        self.cfg = cfg
        self.pad_id = pad_id
        lc = cfg.learner
        init_model_parallel(lc.tp, lc.pp, lc.ep, lc.cp, seed=cfg.trainer.seed)  # no-op after the learner's
        self.device = model_device()
        init = policy if cfg.critic.init_from_policy else None
        model = build_value_model(cfg.model, vocab_size, tp=lc.tp, pp=lc.pp, ep=lc.ep, policy=init)
        self.model, self.optimizer = wrap_for_training(model, lc, cfg.model.dtype == "bf16", self.peak_lr)
        self.optimizer_steps = 0
        self.skipped_in_a_row = 0

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    @property
    def peak_lr(self) -> float:
        return self.cfg.critic.lr if self.cfg.critic.lr is not None else self.cfg.learner.lr

    # ---------------------------------------------------------------- values
    @torch.no_grad()
    def compute_values(self, trajs: Sequence[Trajectory]) -> List[List[float]]:
        return per_token_outputs(self.model, trajs, self.cfg.learner, self.pad_id, self._forward_step)

    def _forward_step(self, data_iterator, model):
        mb: MicroBatch = next(data_iterator).to(self.device)
        out = forward_micro_batch(model, mb)
        return out, lambda output, non_loss_data=True: output[..., 0].float() * mb.loss_mask

    # ---------------------------------------------------------------- training
    def train_step(self, batch: TrainBatch, lr_scale: float = 1.0) -> Dict[str, float]:
        """Regress the batch's values on its GAE returns (PPO epochs × mini-batches, like the
        policy); ``lr_scale`` is the learner's schedule factor at this step."""
        set_lr(self.optimizer, self.peak_lr * lr_scale)
        totals, grad_norms = minibatch_steps(batch, self.cfg.learner, self._optimizer_step)
        tokens = max(totals.pop("tokens", 0.0), 1.0)
        skipped = totals.pop("skipped_steps", 0.0)
        values, returns = padded(batch, batch.get("values")), padded(batch, batch.get("returns"))
        mask = padded(batch, [t.loss_mask for t in batch])
        return {
            "critic/value_loss": totals["value_loss_sum"] / tokens,
            "critic/value_clip_fraction": totals["value_clipped_tokens"] / tokens,
            "critic/value_mse": totals["value_error_sq_sum"] / tokens,
            # Of the critic before this update, on this batch: how much of the returns' variance it explains.
            **value_statistics(values, returns, mask, whole=not batch.local or batch.index.whole),
            "critic/grad_norm": finite_mean(grad_norms),
            "critic/skipped_steps": skipped,
            "critic/skipped_in_a_row": float(self.skipped_in_a_row),
            "critic/lr": self.peak_lr * lr_scale,
        }

    def _optimizer_step(self, batch: TrainBatch) -> Tuple[Dict[str, float], float]:
        stats, grad_norm = optimizer_step(self.model, self.optimizer,
                                          local_micro_batches(batch, self.cfg.learner, self.pad_id),
                                          self._loss_step, what="critic")
        self.optimizer_steps += 1
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if stats["skipped_steps"] else 0
        return stats, grad_norm

    def _loss_step(self, data_iterator, model):
        mb: MicroBatch = next(data_iterator).to(self.device)
        return forward_micro_batch(model, mb), partial(self._value_loss, mb=mb)

    def _value_loss(self, output: torch.Tensor, mb: MicroBatch):
        values = output[..., 0].float()
        loss, stats = clipped_value_loss(values, mb.values, mb.returns, mb.loss_mask, self.cfg.critic.value_clip)
        tokens = mb.loss_mask.sum()
        stats.update(value_loss_sum=loss.sum().detach(), tokens=tokens)
        return loss.sum(), tokens.round().to(torch.int), stats


def value_statistics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, whole: bool) -> Dict[str, float]:
    """Mean value and return over the trained tokens and the critic's explained variance, over
    the step's batch: this rank's rows (``whole``), or every replica's share from their sums."""
    if whole:
        return {"critic/values_mean": float((values * mask).sum() / mask.sum().clamp(min=1)),
                "critic/returns_mean": float((returns * mask).sum() / mask.sum().clamp(min=1)),
                "critic/explained_variance": explained_variance(values, returns, mask)}
    mask = mask.to(returns.dtype)
    error = (returns - values) * mask
    s = sum_over_replicas({"n": float(mask.sum()), "v": float((values * mask).sum()),
                           "r": float((returns * mask).sum()), "rr": float((returns * returns * mask).sum()),
                           "e": float(error.sum()), "ee": float((error * error).sum())})
    n = max(s["n"], 1.0)
    var_r = s["rr"] / n - (s["r"] / n) ** 2
    var_e = s["ee"] / n - (s["e"] / n) ** 2
    return {"critic/values_mean": s["v"] / n, "critic/returns_mean": s["r"] / n,
            "critic/explained_variance": float(1.0 - var_e / var_r) if s["n"] >= 2 and var_r > 0 else 0.0}
