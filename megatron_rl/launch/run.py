"""One RL job over a torchrun world: Megatron learner ranks and embedded engines, either on their
own ranks (disaggregated: weights pushed over the weight-sync groups after every step) or one
per learner rank in a child process (colocated: each rank gathers the full weights and loads its
own engine through shared memory).

Rank 0 (a learner rank) drives: it draws prompts, shares them out over the engines, scores the
returned samples, computes advantages, and hands the batch to every learner rank, which then
train together (each data-parallel replica on its slice) and send the new weights. The loop is
synchronous (generate, train, sync; η = 0). Control messages are small Python objects sent with
``torch.distributed``'s object collectives over the whole world; weights go through
``weights.sync`` as flat byte buckets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from itertools import islice
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..config.schema import RootConfig
from ..types import SamplingParams, Trajectory
from .groups import init_split_parallel_state
from .plan import Plan

logger = logging.getLogger(__name__)

DRIVER = 0


def _send(obj, dst: int) -> None:
    dist.send_object_list([obj], dst=dst, group=dist.group.WORLD)


def _recv(src: int):
    box = [None]
    dist.recv_object_list(box, src=src, group=dist.group.WORLD)
    return box[0]


def _sampling(cfg: RootConfig, eos_id: int) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens, stop_token_ids=(eos_id,), stream=False)


def run_split_world(cfg: RootConfig, plan: Plan) -> Optional[Dict[str, float]]:
    """Every rank of the world calls this; rank 0 returns the last step's metrics."""
    from ..data.build import build_data
    from ..models.gpt import padded_vocab_size
    from ..weights.sync import SyncTopology, build_sync_groups

    lc = cfg.learner
    colocated = plan.layout.placement == "colocated"
    role = init_split_parallel_state(len(plan.learner_ranks), lc.tp, lc.pp, lc.ep, lc.cp,
                                     engine_tp=cfg.rollout.tp, seed=cfg.trainer.seed)
    groups = None if colocated else build_sync_groups(SyncTopology(plan.sync_sources, plan.engine_ranks))
    tokenizer, prompts = build_data(cfg)
    vocab = padded_vocab_size(tokenizer.vocab_size, lc.tp)
    if role == "engine":
        info = plan.ranks[dist.get_rank()]
        _serve_engine(cfg, vocab, groups, engine_index=info.engine or 0)
        return None
    from ..learner.learner import Learner

    learner = Learner(cfg, vocab, pad_id=tokenizer.pad_id)
    local = _LocalEngine(cfg, vocab, learner) if colocated else None
    try:
        driver = _Driver(cfg, plan, learner, groups, tokenizer, prompts, local) if dist.get_rank() == DRIVER else None
        summary = driver.run() if driver else (_follow_colocated(cfg, local) if local else _follow(cfg, learner, groups))
    finally:
        if local is not None:
            local.close()
    if cfg.trainer.save_final_checkpoint:
        _save_final(cfg, learner, driver)
    return summary


def _save_final(cfg: RootConfig, learner, driver) -> None:
    """Megatron dist_checkpointing across the learner ranks (its collectives run on the default
    group, which is the learner group on these ranks), in the driver's run directory."""
    from pathlib import Path

    from ..checkpoint import save_checkpoint

    box = [(str(driver.run_dir), driver.steps_done) if driver else None]
    dist.broadcast_object_list(box, src=DRIVER)
    run_dir, step = box[0]
    save_checkpoint(learner, Path(run_dir) / "checkpoints", step, {"policy_version": step},
                    keep=cfg.trainer.checkpoint_keep)


# ---------------------------------------------------------------------------- engine ranks
def _serve_engine(cfg: RootConfig, vocab: int, groups, engine_index: int) -> None:
    from ..rollout.embedded import EmbeddedEngine
    from ..rollout.workflow import generate_groups
    from ..weights.sync import receive_weights

    loop = asyncio.new_event_loop()
    # Each engine samples with its own stream of random numbers.
    engine = EmbeddedEngine(cfg.model, vocab, cfg.rollout.max_batch_size, seed=cfg.trainer.seed + 1 + engine_index)

    def load() -> None:
        version, tensors, stats = receive_weights(groups)

        loop.run_until_complete(engine.swap_weights(tensors.items(), version))
        logger.debug("engine %d: weights v%d, %.1f MB in %.3f s", engine_index, version, stats.bytes / 1e6, stats.seconds)

    async def generate(work: List[Tuple[object, int]], params: SamplingParams, step: int) -> List[List[Trajectory]]:
        return await generate_groups(engine, work, params, f"s{step}")

    load()  # the learner's initial weights
    while True:
        msg = _recv(DRIVER)
        if msg[0] == "stop":
            break
        _, step, work, params = msg
        before = engine.stats.compute_s
        groups_out = loop.run_until_complete(generate(work, params, step))
        _send((groups_out, engine.stats.compute_s - before), DRIVER)
        load()
    loop.run_until_complete(engine.shutdown())
    loop.close()


# ---------------------------------------------------------------------------- colocated
class _LocalEngine:
    """Colocated placement: this learner rank's engine, an embedded engine in a child process
    (its own interpreter; idle while the learner trains), loaded from this rank's gathered
    weights through shared memory."""

    def __init__(self, cfg: RootConfig, vocab: int, learner):
        from ..rollout.embedded import EngineProcess

        self.cfg, self.learner = cfg, learner
        self.loop = asyncio.new_event_loop()
        self.engine = EngineProcess(cfg.model, vocab, cfg.rollout.max_batch_size,
                                    seed=cfg.trainer.seed + 1 + dist.get_rank(), cpu_threads=1,
                                    recompute_kv_on_update=cfg.rollout.recompute_kv_on_update,
                                    # this rank's GPU (the child would otherwise start on cuda:0)
                                    device_index=torch.cuda.current_device() if torch.cuda.is_available() else None)

    def push(self, version: int) -> Tuple[float, int]:
        """Every learner rank: gather the full weights, load them into this rank's engine."""
        from ..weights.sync import all_hf_tensors

        start = time.perf_counter()
        tensors = all_hf_tensors(self.learner.module, self.cfg.model)

        async def swap():
            await self.engine.wake_up()
            await self.engine.swap_weights(tensors.items(), version)

        self.loop.run_until_complete(swap())
        return time.perf_counter() - start, sum(t.numel() * t.element_size() for t in tensors.values())

    def train(self, trajs: Sequence[Trajectory], lr: float) -> Dict[str, float]:
        # The engine gives its accelerator memory back while the learner trains (a no-op for the
        # embedded engine on CPU, which just idles in its process); push() wakes it.
        self.loop.run_until_complete(self.engine.sleep())
        return self.learner.train_step(trajs, self.cfg.rollout.temperature, lr)

    def generate(self, work, params: SamplingParams, step: int) -> List[List[Trajectory]]:
        from ..rollout.workflow import generate_groups

        return self.loop.run_until_complete(generate_groups(self.engine, work, params, f"s{step}"))

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()


def _follow_colocated(cfg: RootConfig, local: _LocalEngine) -> None:
    """Non-driver ranks of a colocated world: generate this rank's share, then train and push."""
    local.push(0)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=DRIVER)
        if box[0][0] == "stop":
            break
        if box[0][0] == "generate":
            _, step, shares, params = box[0]
            dist.gather_object(local.generate(shares[dist.get_rank()], params, step), None, dst=DRIVER)
        else:
            _, trajs, lr, version = box[0]
            local.train(trajs, lr)
            local.push(version)


# ---------------------------------------------------------------------------- learner ranks
def _train_and_sync(cfg: RootConfig, learner, groups, trajs: Sequence[Trajectory], lr: float, version: int):
    from ..weights.sync import send_weights

    metrics = learner.train_step(trajs, cfg.rollout.temperature, lr)
    stats = send_weights(learner.module, cfg.model, groups, version)
    return metrics, stats


def _follow(cfg: RootConfig, learner, groups) -> None:  # noqa: D401 - returns None: only rank 0 reports
    from ..weights.sync import send_weights

    send_weights(learner.module, cfg.model, groups, version=0)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=DRIVER)  # the learner group (the redirected default)
        if box[0][0] == "stop":
            break
        _, trajs, lr, version = box[0]
        _train_and_sync(cfg, learner, groups, trajs, lr, version)


class _Driver:
    def __init__(self, cfg: RootConfig, plan: Plan, learner, groups, tokenizer, prompts, local=None):
        from ..rewards import REWARDS, RewardRunner
        from ..telemetry.metrics import MetricsWriter, Timeline
        from ..telemetry.run_dir import make_run_dir, setup_logging

        self.cfg, self.plan, self.learner, self.groups, self.local = cfg, plan, learner, groups, local
        self.tokenizer, self.prompts = tokenizer, iter(prompts)
        self.run_dir = make_run_dir(cfg)
        setup_logging(self.run_dir / "logs" / "train.log")
        tokenizer.save(self.run_dir / "tokenizer.json")
        self.metrics = MetricsWriter(self.run_dir)
        self.timeline = Timeline(self.run_dir / "timeline.jsonl")
        self.rewards = RewardRunner(REWARDS[cfg.reward.name], cfg.reward.workers, cfg.reward.timeout_s,
                                    name=f"reward {cfg.reward.name}")
        self.params = _sampling(cfg, tokenizer.eos_id)
        self.engine_heads = [g[0] for g in plan.engine_groups]
        self.loop = asyncio.new_event_loop()
        self.steps_done = 0
        logger.info("split world:\n%s", plan.table())
        if cfg.scheduler.max_staleness > 0:
            # Said once, where a person reads the run: the recipe asked for overlap it will not get.
            logger.warning("scheduler.max_staleness=%d: the torchrun split world runs the synchronous loop "
                           "(generate, train, sync; eta = 0) for now; the asynchronous controller runs in the "
                           "single-process trainer (python -m megatron_rl.main)", cfg.scheduler.max_staleness)

    def run(self) -> Dict[str, float]:
        from ..trainer import lr_at
        from ..weights.sync import SyncStats, send_weights

        cfg = self.cfg
        if self.local:
            self.local.push(0)
        else:
            send_weights(self.learner.module, cfg.model, self.groups, version=0)
        metrics: Dict[str, float] = {}
        try:
            for step in range(1, cfg.trainer.total_steps + 1):
                t0 = time.perf_counter()
                prompts = list(islice(self.prompts, cfg.algo.groups_per_batch))
                with self.timeline.span("generate", step=step):
                    groups, engine_s = self._generate(prompts, step)
                t1 = time.perf_counter()
                with self.timeline.span("reward", step=step):
                    self.loop.run_until_complete(self._score(prompts, groups))
                self._advantages(groups)
                flat = [t for g in groups for t in g]
                metrics = self._batch_metrics(flat)
                lr = lr_at(cfg, step)
                t2 = time.perf_counter()
                with self.timeline.span("train", step=step):
                    dist.broadcast_object_list([("train", flat, lr, step)], src=DRIVER)
                    if self.local:
                        train_metrics = self.local.train(flat, lr)
                        seconds, nbytes = self.local.push(step)
                        sync = SyncStats(step, seconds=seconds, bytes=nbytes)
                    else:
                        train_metrics, sync = _train_and_sync(cfg, self.learner, self.groups, flat, lr, step)
                t3 = time.perf_counter()
                metrics.update(train_metrics)
                generated = sum(len(t.response_ids) for t in flat)
                metrics.update({
                    "time/generate_s": t1 - t0, "time/train_and_sync_s": t3 - t2, "time/step_s": t3 - t0,
                    "time/engine_compute_s_max": max(engine_s), "perf/generate_tokens_per_s": generated / (t1 - t0),
                    "sync/seconds": sync.seconds if sync else float("nan"),
                    "sync/gb_per_s": sync.gb_per_s if sync else float("nan"),
                    "sync/bytes": float(sync.bytes) if sync else 0.0, "policy/version": float(step),
                })
                self.metrics.write(step, metrics)
                self.steps_done = step
                if step == 1 or step % cfg.trainer.log_interval == 0:
                    logger.info("step %d: reward %.3f, loss %.4f, %.2f s", step, metrics["reward/mean"],
                                metrics["train/loss"], t3 - t0)
        finally:
            for head in ([] if self.local else self.engine_heads):
                _send(("stop",), head)
            dist.broadcast_object_list([("stop",)], src=DRIVER)
            self.metrics.close()
            self.timeline.close()
            self.rewards.close()
            self.loop.close()
        return metrics

    def _generate(self, prompts, step: int) -> Tuple[List[List[Trajectory]], List[float]]:
        if self.local:
            return self._generate_colocated(prompts, step)
        g = self.cfg.algo.group_size
        n = len(self.engine_heads)
        shares = [[(p, g) for p in prompts[e::n]] for e in range(n)]  # round robin over engines
        for head, share in zip(self.engine_heads, shares):
            _send(("generate", step, share, self.params), head)
        replies = [_recv(head) for head in self.engine_heads]
        groups: List[Optional[List[Trajectory]]] = [None] * len(prompts)
        for e, (out, _) in enumerate(replies):
            for j, group in enumerate(out):
                groups[e + j * n] = group
        return groups, [seconds for _, seconds in replies]  # type: ignore[return-value]

    def _generate_colocated(self, prompts, step: int) -> Tuple[List[List[Trajectory]], List[float]]:
        """Every rank generates its share on its own engine; the groups come back here."""
        g, n = self.cfg.algo.group_size, dist.get_world_size()
        shares = [[(p, g) for p in prompts[r::n]] for r in range(n)]
        start = time.perf_counter()
        dist.broadcast_object_list([("generate", step, shares, self.params)], src=DRIVER)
        mine = self.local.generate(shares[DRIVER], self.params, step)
        replies: List = [None] * n
        dist.gather_object(mine, replies, dst=DRIVER)
        groups: List[Optional[List[Trajectory]]] = [None] * len(prompts)
        for r, out in enumerate(replies):
            for j, group in enumerate(out):
                groups[r + j * n] = group
        return groups, [time.perf_counter() - start]  # type: ignore[return-value]

    async def _score(self, prompts, groups: List[List[Trajectory]]) -> None:
        from ..rewards import score_groups

        await score_groups(self.rewards, self.tokenizer.decode_response, [p.target for p in prompts], groups,
                           self.cfg.reward, self.cfg.rollout.max_new_tokens)

    def _advantages(self, groups: List[List[Trajectory]]) -> None:
        from ..algorithms.advantages import assign_group_advantages

        assign_group_advantages(groups, self.cfg.algo)

    @staticmethod
    def _batch_metrics(flat: Sequence[Trajectory]) -> Dict[str, float]:
        rewards = np.array([t.reward for t in flat])
        lengths = np.array([len(t.response_ids) for t in flat])
        return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
                "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max())}
