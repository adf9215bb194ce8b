"""The synchronous RL loop: generate G samples per prompt → score → group advantages → train →
push the new weights to the engine. Every step leaves metrics, timeline spans and logs in the run
directory; the last step leaves a checkpoint. (The staleness-bounded asynchronous controller
builds on the same pieces.)"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from itertools import islice
from typing import Dict, List, Sequence

import numpy as np
import torch

from .algorithms import group_relative_advantages
from .checkpoint import save_checkpoint
from .config.schema import RootConfig
from .data.build import build_data
from .data.datasets import Prompt
from .learner.learner import Learner
from .models.gpt import padded_vocab_size
from .rewards import REWARDS, RewardRunner
from .rollout.embedded import EmbeddedEngine
from .rollout.workflow import single_turn
from .telemetry.metrics import MetricsWriter, Timeline
from .telemetry.progress import Progress
from .telemetry.run_dir import make_run_dir, setup_logging
from .types import SamplingParams, Trajectory

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(cfg: RootConfig, step: int) -> float:
    """Linear warm-up over ``learner.lr_warmup_steps``, then constant."""
    warmup = cfg.learner.lr_warmup_steps
    return cfg.learner.lr * min(1.0, (step + 1) / warmup) if warmup else cfg.learner.lr


class Trainer:
    def __init__(self, cfg: RootConfig):
        self.cfg = cfg
        self.run_dir = make_run_dir(cfg)
        setup_logging(self.run_dir / "logs" / "train.log")
        if cfg.trainer.cpu_threads:
            torch.set_num_threads(cfg.trainer.cpu_threads)
        seed_everything(cfg.trainer.seed)
        self.tokenizer, prompts = build_data(cfg)
        self.tokenizer.save(self.run_dir / "tokenizer.json")
        self.prompts = iter(prompts)
        vocab = padded_vocab_size(self.tokenizer.vocab_size, cfg.learner.tp)
        self.learner = Learner(cfg, vocab, pad_id=self.tokenizer.pad_id)
        self.engine = EmbeddedEngine(cfg.model, vocab, cfg.rollout.max_batch_size, seed=cfg.trainer.seed)
        self.rewards = RewardRunner(REWARDS[cfg.reward.name], cfg.reward.workers, cfg.reward.timeout_s,
                                    name=f"reward {cfg.reward.name}")
        r = cfg.rollout
        self.params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens,
                                     stop_token_ids=(self.tokenizer.eos_id,))
        self.metrics = MetricsWriter(self.run_dir)
        self.timeline = Timeline(self.run_dir / "timeline.jsonl")
        self.samples = (self.run_dir / "samples.jsonl").open("a", buffering=1)
        self.version = 0
        logger.info("run directory: %s", self.run_dir)

    # ------------------------------------------------------------------ pieces of a step
    async def sync_weights(self) -> None:
        await self.engine.pause()
        await self.engine.update_weights(self.learner.export_hf_weights(), self.version)
        await self.engine.resume()

    async def generate(self, prompts: Sequence[Prompt], step: int) -> List[List[Trajectory]]:
        g = self.cfg.algo.group_size
        jobs = [single_turn(self.engine, p, i, self.params, f"s{step}-{p.uid}-{i}") for p in prompts for i in range(g)]
        flat = await asyncio.gather(*jobs)
        return [list(flat[k * g : (k + 1) * g]) for k in range(len(prompts))]

    def score(self, prompts: Sequence[Prompt], groups: List[List[Trajectory]]) -> None:
        items = [(self.tokenizer.decode_response(t.response_ids), p.target) for p, grp in zip(prompts, groups) for t in grp]
        scores = iter(self.rewards.score_many(items))
        for grp in groups:
            for traj in grp:
                traj.reward = next(scores)

    def assign_advantages(self, groups: List[List[Trajectory]]) -> None:
        rewards = torch.tensor([[t.reward for t in grp] for grp in groups], dtype=torch.float64)
        adv = group_relative_advantages(rewards, self.cfg.algo.normalize_adv_by_std, self.cfg.algo.adv_eps)
        for grp, row in zip(groups, adv.tolist()):
            for traj, a in zip(grp, row):
                traj.advantage = a

    def log_samples(self, step: int, prompts: Sequence[Prompt], groups: List[List[Trajectory]], n: int = 4) -> None:
        """A few decoded responses per logged step, for a person reading the run directory."""
        if step != 1 and step % self.cfg.trainer.log_interval:
            return
        for traj in groups[0][:n]:
            self.samples.write(json.dumps({
                "step": step, "prompt": prompts[0].text, "target": prompts[0].target,
                "response": self.tokenizer.decode_response(traj.response_ids),
                "finish_reason": traj.finish_reason, "reward": traj.reward}) + "\n")

    # ------------------------------------------------------------------ the loop
    async def train_step(self, step: int) -> Dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        prompts = list(islice(self.prompts, cfg.algo.groups_per_batch))
        with self.timeline.span("generate", step=step):
            groups = await self.generate(prompts, step)
        t1 = time.perf_counter()
        with self.timeline.span("reward", step=step):
            self.score(prompts, groups)
        self.assign_advantages(groups)
        self.log_samples(step, prompts, groups)
        t2 = time.perf_counter()
        flat = [t for grp in groups for t in grp]
        with self.timeline.span("train", step=step):
            metrics = self.learner.train_step(flat, cfg.rollout.temperature, lr_at(cfg, step))
        self.version += 1
        t3 = time.perf_counter()
        with self.timeline.span("sync", step=step, version=self.version):
            await self.sync_weights()
        t4 = time.perf_counter()
        rewards = np.array([t.reward for t in flat])
        lengths = np.array([len(t.response_ids) for t in flat])
        gen_tokens = int(lengths.sum())
        train_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in flat)
        metrics.update({
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/solved_fraction": float((rewards >= 1.0).mean()),
            "reward/errors": float(self.rewards.counts["error"]),
            "reward/timeouts": float(self.rewards.counts["timeout"]),
            "response/length_mean": float(lengths.mean()),
            "response/truncated_fraction": float(np.mean([t.finish_reason == "length" for t in flat])),
            "perf/generate_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(t3 - t2, 1e-9),
            "perf/step_tokens_per_s": (gen_tokens + train_tokens) / max(t4 - t0, 1e-9),
            "time/generate_s": t1 - t0,
            "time/reward_s": t2 - t1,
            "time/train_s": t3 - t2,
            "time/sync_s": t4 - t3,
            "time/step_s": t4 - t0,
            "policy/version": float(self.version),
        })
        return metrics

    async def _run(self) -> Dict[str, float]:
        cfg = self.cfg.trainer
        await self.sync_weights()  # the engine starts from the learner's initial weights
        history: List[Dict[str, float]] = []
        with Progress(cfg.total_steps, enabled=cfg.progress) as progress:
            for step in range(1, cfg.total_steps + 1):
                metrics = await self.train_step(step)
                history.append(metrics)
                self.metrics.write(step, metrics)
                progress.update(step, metrics)
                if step % cfg.log_interval == 0 or step == cfg.total_steps:
                    logger.info("step %d/%d reward %.3f loss %.4f entropy %.3f len %.1f %.2fs",
                                step, cfg.total_steps, metrics["reward/mean"], metrics["train/loss"],
                                metrics["train/entropy"], metrics["response/length_mean"], metrics["time/step_s"])
                if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 and step < cfg.total_steps:
                    self.save(step)
        if cfg.save_final_checkpoint:
            self.save(cfg.total_steps)
        await self.engine.shutdown()
        return summarize(history)

    def save(self, step: int) -> None:
        with self.timeline.span("checkpoint", step=step):
            save_checkpoint(self.learner, self.run_dir / "checkpoints", step,
                            {"policy_version": self.version}, keep=self.cfg.trainer.checkpoint_keep)

    def run(self) -> Dict[str, float]:
        try:
            summary = asyncio.run(self._run())
        finally:
            self.metrics.close()
            self.timeline.close()
            self.samples.close()
            self.rewards.close()
        logger.info("done: reward %.3f (first steps) -> %.3f (last steps); run dir %s",
                    summary["reward_first"], summary["reward_last"], self.run_dir)
        return summary


def summarize(history: List[Dict[str, float]], window: int = 5) -> Dict[str, float]:
    rewards = [m["reward/mean"] for m in history]
    k = min(window, len(rewards))
    return {
        "steps": float(len(history)),
        "reward_first": float(np.mean(rewards[:k])),
        "reward_last": float(np.mean(rewards[-k:])),
        "reward_max": float(max(rewards)),
        "seconds": float(sum(m["time/step_s"] for m in history)),
    }
