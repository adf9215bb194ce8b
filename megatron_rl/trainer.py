"""The driver of every placement: it receives a run's components (``megatron_rl.build``) and
its context (run directory and writers, ``telemetry/run_context.py``) and drives them.

One step: G samples per prompt → rewards → group advantages → train → push the new weights to
the engines, all through the staleness-bounded controller (scheduler/controller.py), the one
loop there is: rollouts overlap training under η, and η = 0 is the synchronous on-policy loop
(one batch generated per version). Every step leaves metrics, timeline spans and logs in the
run directory; the last step leaves a checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .checkpoint.resume import capture_rng, restore_rng
from .config.schema import RootConfig
from .data.datasets import Prompt
from .learner.teachers import row_teacher
from .plugins import PluginError
from .rewards import score_groups
from .rewards.runner import RewardFailing
from .rollout.agent import AgentError, agent_metrics, runs
from .api.engine import EngineError, raise_if_gone, whole_response
from .scheduler.controller import AsyncController, GroupFailed, RolloutsStopped
from .scheduler.ledger import FinishedGroup, PromptLedger, Ticket, max_ahead_groups
from .scheduler.staleness import StalenessManager
from .stop import StopRequested
from .telemetry.metrics import forget_spans_after
from .telemetry.progress import Progress
from .telemetry.step_metrics import EngineCounters
from .telemetry.run_context import RunContext
from .types import SamplingParams, Trajectory

from .components import Components  # built by the composition root (megatron_rl/build.py)

logger = logging.getLogger(__name__)


class TrainingStopped(RolloutsStopped):
    """The learner cannot go on (steps skipped for non-finite values, weights no longer finite):
    the run stops like one whose rollouts cannot go on, with one line and no checkpoint."""


def extra_reward_metrics(flat: Sequence[Trajectory]) -> Dict[str, float]:
    """``reward/extra/<key>``: the mean of each number the reward's dicts returned besides the
    reward, over the trajectories whose reward returned it."""
    values: Dict[str, List[float]] = {}
    for traj in flat:
        for key, value in traj.reward_info.items():
            values.setdefault(key, []).append(value)
    return {f"reward/extra/{key}": float(np.mean(v)) for key, v in sorted(values.items())}


def lr_at(cfg: RootConfig, step: int) -> float:
    """Learning rate of ``step`` (1-based): linear warm-up over ``learner.lr_warmup_steps``, then
    ``learner.lr_decay_style`` from ``lr`` to ``min_lr`` at ``learner.lr_decay_steps`` (default
    ``trainer.total_steps``)."""
    lc = cfg.learner
    warmup = lc.lr_warmup_steps
    if warmup and step < warmup:
        return lc.lr * (step + 1) / warmup
    end = lc.lr_decay_steps or cfg.trainer.total_steps
    span = max(end - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if lc.lr_decay_style == "linear":
        return lc.min_lr + (lc.lr - lc.min_lr) * (1.0 - progress)
    if lc.lr_decay_style == "cosine":
        return lc.min_lr + (lc.lr - lc.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lc.lr


class Trainer:
    """The driver of a run, the same in every placement: data, engines, rewards, the
    staleness-bounded controller, metrics, checkpoints. Learner work goes through
    ``self.learners`` (every learner rank runs it) on the learner thread; weights reach the
    engines through ``self.transport``."""

    def __init__(self, cfg: RootConfig, components: Components, context: RunContext):
        """``components``: the run's parts (``megatron_rl.build.build``); ``context``: its run
        directory and writers (``RunContext``). The driver builds nothing itself."""
        self.cfg, self.components, self.context = cfg, components, context
        c = components
        self.tokenizer, self.prompts, self.worker, self.learners = c.tokenizer, c.prompts, c.worker, c.learners
        self.engine, self.transport, self.workflow, self.rewards = c.engine, c.transport, c.workflow, c.rewards
        self.evaluator, self.learner_executor = c.evaluator, c.learner_executor
        r = cfg.rollout
        # With rollout.seed_by_request each request samples from its own random stream (seeded
        # by the run's seed and its id), so its tokens do not depend on the engine serving it.
        self.params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens,
                                     stop_token_ids=self.tokenizer.stop_ids, stream=False,
                                     seed=cfg.trainer.seed if r.seed_by_request else None)
        self._engine_counters = EngineCounters(self.engine.stats)
        self._sync_metrics: Dict[str, float] = {}
        sc = cfg.scheduler
        self.ledger = PromptLedger(self.prompts, StalenessManager(
            sc.max_staleness, cfg.algo.groups_per_batch, sc.max_concurrent_rollouts),
            max_ahead_groups=max_ahead_groups(sc.max_ahead_batches, cfg.algo.groups_per_batch),
            filter_equal_rewards=cfg.algo.filter_groups, overdue=sc.overdue)
        self.controller = AsyncController(self.ledger, self.rollout_group, self.train_groups, self.publish,
                                          train_executor=self.learner_executor,
                                          max_filtered_batches=cfg.algo.filter_max_batches)
        self.start_step = 1
        self._engine_sampling_state: Optional[bytes] = None
        self._eval_s = 0.0
        if cfg.trainer.resume:
            self.resume()  # last: the random states it restores must not be consumed by set-up
        context.open_step_writers(self.start_step)

    @property
    def version(self) -> int:
        """The policy version last published to the engines."""
        return self.components.policy.value

    @version.setter
    def version(self, value: int) -> None:
        self.components.policy.value = value

    @property
    def run_dir(self) -> Path:
        return self.context.dir

    async def run_on_learners(self, name: str, *args: Any) -> Any:
        """``LearnerWorker.<name>(*args)`` on every learner rank, from the learner thread (every
        call to the learner ranks is made there, so they arrive in one order)."""
        return await asyncio.get_running_loop().run_in_executor(self.learner_executor, self.learners.call, name, *args)

    # ------------------------------------------------------------------ pieces of a step
    async def sync_weights(self) -> None:
        self._sync_metrics = (await self.transport.push(self.version)).as_dict()
        if self.cfg.rollout.check_sync:
            try:
                self._sync_metrics["sync/probe_gap"] = await self.probe_engines()
            except EngineError:
                raise_if_gone([self.engine])
                raise

    async def probe_engines(self, new_tokens: int = 8) -> float:
        """Every engine samples a fixed probe with the version just pushed; the learner scores the
        same tokens. Returns the largest |engine - learner| logprob gap over all engines."""
        engines = self.engine.engines
        prompt = [1 + i % (self.worker.vocab_size - 1) for i in range(8)]
        params = SamplingParams(self.cfg.rollout.temperature, max_new_tokens=new_tokens, stream=False,
                                seed=self.cfg.trainer.seed)
        responses = await asyncio.gather(*(whole_response(e.generate(f"probe-v{self.version}-e{i}", prompt, params))
                                           for i, e in enumerate(engines)))
        trajs = [Trajectory("probe", i, prompt, r.token_ids, r.logprobs, r.versions, r.finish_reason or "length")
                 for i, r in enumerate(responses)]
        stale = [t.versions for t in trajs if set(t.versions) != {self.version}]
        if stale:
            raise EngineError(f"an engine answered the sync probe with weights of versions {stale[0]}, "
                              f"not the v{self.version} just pushed")
        ours = await self.run_on_learners("logprobs", trajs, self.cfg.rollout.temperature)
        return max(abs(a - b) for t, row in zip(trajs, ours) for a, b in zip(t.logprobs, row))

    async def score(self, prompts: Sequence[Prompt], groups: List[List[Trajectory]]) -> None:
        await score_groups(self.rewards, self.tokenizer.decode_response, prompts, groups,
                           self.cfg.reward, self.cfg.rollout.max_new_tokens)

    def log_samples(self, step: int, prompts: Sequence[Prompt], groups: List[List[Trajectory]], n: int = 4) -> None:
        """A few decoded responses per logged step, for a person reading the run directory."""
        if step != 1 and step % self.cfg.trainer.log_interval:
            return
        for traj in groups[0][:n]:
            self.context.samples.write(json.dumps({
                "step": step, "prompt": prompts[0].text, "target": prompts[0].target,
                "response": self.tokenizer.decode_response(traj.response_ids),
                "finish_reason": traj.finish_reason, "reward": traj.reward}) + "\n")

    def train_on(self, prompts: Sequence[Prompt], groups: List[List[Trajectory]], version: int) -> Dict[str, float]:
        """One learner update of policy ``version`` (step ``version + 1``) on every learner rank,
        and the batch's metrics. Runs on the learner thread."""
        step = version + 1
        metrics = self.batch_metrics(groups, version)  # the verifier's rewards, before any KL charge
        # Distillation from several teachers: each group's, named by its prompt's row.
        teachers = ([row_teacher(p.row, self.cfg.teacher, f"prompt {p.uid}") for p in prompts]
                    if self.cfg.teacher.paths else None)
        with self.context.timeline.span("train", step=step):
            metrics.update(self.learners.train(groups, version, lr_at(self.cfg, step), teachers))
        self.log_samples(step, prompts, groups)  # with the advantages the learner assigned
        return metrics

    def batch_metrics(self, groups: Sequence[Sequence[Trajectory]], train_version: int) -> Dict[str, float]:
        """Reward, length and staleness statistics of one training batch; rewards per run (an
        agent run of several trajectories counts once), lengths and staleness per trajectory."""
        flat = [t for grp in groups for t in grp]
        rewards = np.array([t.reward for t in runs(groups)])
        lengths = np.array([len(t.response_ids) for t in flat])
        staleness = np.array([train_version - t.oldest_version for t in flat if len(t.versions)])
        return {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/solved_fraction": float((rewards >= 1.0).mean()),
            "reward/errors": float(self.rewards.counts["error"]),
            "reward/timeouts": float(self.rewards.counts["timeout"]),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_fraction": float(np.mean([t.finish_reason == "length" for t in flat])),
            "staleness/mean": float(staleness.mean()) if staleness.size else 0.0,
            "staleness/max": float(staleness.max()) if staleness.size else 0.0,
            "staleness/histogram": np.bincount(staleness.astype(int), minlength=self.cfg.scheduler.max_staleness + 1).tolist()
            if staleness.size else [],
            "policy/version": float(train_version + 1),
            **agent_metrics(groups),
            **extra_reward_metrics(flat),
        }

    def tokens(self, flat: Sequence[Trajectory]) -> Tuple[int, int]:
        """(generated tokens, trained tokens) of a batch."""
        generated = sum(len(t.response_ids) for t in flat)
        return generated, generated + sum(len(t.prompt_ids) for t in flat)

    # ------------------------------------------------------------------ asynchronous pieces
    async def rollout_group(self, ticket: Ticket) -> List[Trajectory]:
        """G samples of one prompt, scored; an aborted sample fails the group (prompt retried)."""
        g, p = self.cfg.algo.group_size, ticket.prompt
        with self.context.timeline.span("generate", group=ticket.index):
            try:
                trajs = await self.workflow(self.engine, p, self.params,
                                            [f"g{ticket.index}-{p.uid}-{i}" for i in range(g)])
            except EngineError:
                raise_if_gone([self.engine])
                raise
            except AgentError as err:  # the agent broke its contract, and every run would: stop
                raise RolloutsStopped(str(err)) from None
        aborted = sum(t.finish_reason == "abort" for t in trajs)
        if aborted:
            raise GroupFailed(f"{aborted} of {g} samples aborted")
        trajs = list(trajs)
        if not self.workflow.sets_rewards:  # agents return their runs' rewards
            with self.context.timeline.span("reward", group=ticket.index):
                try:
                    await self.score([p], [trajs])
                except (PluginError, RewardFailing) as err:  # every group would fail the same way: stop
                    raise RolloutsStopped(str(err)) from None
        return trajs

    def train_groups(self, groups: List[FinishedGroup], version: int) -> Dict[str, float]:
        """Runs on the learner thread while rollouts continue."""
        metrics = self.train_on([g.ticket.prompt for g in groups], [g.trajectories for g in groups], version)
        self.context.trained.write(version + 1, version, groups)
        return metrics

    async def publish(self, version: int) -> None:
        with self.context.timeline.span("sync", version=version):
            self.version = version
            await self.sync_weights()  # a dead engine is named there (weights/transports.py)

    # ------------------------------------------------------------------ checkpoints
    def resume(self) -> None:
        """Continue from the newest loadable checkpoint of this run directory, if there is one:
        weights and optimizers, random states, the position in the prompt stream, the policy
        version and the prompts that were waiting or in flight (they are generated again)."""
        found = self.learners.call("resume", str(self.context.checkpoints))
        if found is None:
            return
        path, state = found
        self.start_step = state["step"] + 1
        self.version = self.controller.version = state["policy_version"]
        self.prompts.skip(state["prompts_drawn"])
        self.ledger.load_state_dict(state["ledger"])
        restore_rng(state["rng"])
        if "saved_at" in state:  # the dead run's spans after its checkpoint are for work done again
            forget_spans_after(self.run_dir / "timeline.jsonl", state["saved_at"], state["step"], self.version)
        engine_state = state.get("engine_sampling_state")
        self._engine_sampling_state = bytes.fromhex(engine_state) if engine_state else None
        logger.info("resumed from %s: step %d, policy version %d", path, state["step"], self.version)

    async def save(self, step: int) -> Path:
        if not await self.run_on_learners("weights_finite"):
            raise TrainingStopped(f"the weights are not finite after step {step}; no checkpoint was written (the "
                                  "newest one is the last good state): lower learner.lr, or check the rewards")
        engine_state = await self.engine.sampling_state()
        state = {
            "policy_version": self.version,
            "prompts_drawn": self.prompts.drawn,
            "ledger": self.ledger.state_dict(),
            "rng": capture_rng(),
            "engine_sampling_state": engine_state.hex() if engine_state is not None else None,
            "saved_at": time.time(),
        }
        with self.context.timeline.span("checkpoint", step=step):
            path = await self.run_on_learners("save", str(self.context.checkpoints), step, state,
                                              "hf" if self.cfg.trainer.export_hf else None, str(self.run_dir))
            return Path(path)

    async def stop_requested(self) -> bool:
        """A stop signal or file on any learner rank (they all stop after the same step)."""
        return await self.run_on_learners("any_rank_asked", self.context.stop_watch.requested())

    # ------------------------------------------------------------------ the run
    async def after_step(self, step: int, metrics: Dict[str, float], history: List[Dict[str, float]],
                         progress: Progress) -> None:
        cfg = self.cfg.trainer
        if cfg.eval_interval and step % cfg.eval_interval == 0:
            metrics.update(await self.validate(step))
        history.append(metrics)
        self.context.metrics.write(step, metrics)
        progress.update(step, metrics)
        if step % cfg.log_interval == 0 or step == cfg.total_steps:
            logger.info("step %d/%d reward %.3f loss %.4f entropy %.3f len %.1f staleness %.2f %.2fs",
                        step, cfg.total_steps, metrics["reward/mean"], metrics["train/loss"],
                        metrics["train/entropy"], metrics["response/length_mean"],
                        metrics["staleness/mean"], metrics["time/step_s"])
        self.check_skipped_steps(metrics)
        if step < cfg.total_steps and await self.stop_requested():
            raise StopRequested(step, await self.save(step))
        if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 and step < cfg.total_steps:
            await self.save(step)

    async def validate(self, step: int) -> Dict[str, float]:
        """pass@k of the eval sets with the weights of ``step`` (just published to the engine).

        Runs between steps on the trainer's engine: rollouts admitted earlier go on meanwhile and
        no prompt is admitted or taken from the ledger for it, so the staleness accounting is
        untouched. Its requests sample from their own seeded streams (ids carry the step), so a
        resumed run scores the same steps the same way."""
        start = time.perf_counter()
        with self.context.timeline.span("eval", step=step):
            results = await self.evaluator.score(self.engine, tag=f"eval-s{step}")
        metrics = self.evaluator.metrics(results)
        self._eval_s = time.perf_counter() - start
        metrics["time/eval_s"] = self._eval_s
        logger.info("step %d eval: %s", step, ", ".join(
            f"{name} pass@1 {r['pass@1']:.3f} ({r['problems']} problems)" for name, r in results.items()))
        return metrics

    def check_skipped_steps(self, metrics: Dict[str, float]) -> None:
        """Stop when ``learner.max_skipped_steps`` optimizer steps in a row (policy or critic)
        were skipped for a non-finite loss or gradient norm: the run is not training any more."""
        limit = self.cfg.learner.max_skipped_steps
        in_a_row = max(metrics.get("train/skipped_in_a_row", 0.0), metrics.get("critic/skipped_in_a_row", 0.0))
        if limit and in_a_row >= limit:
            raise TrainingStopped(
                f"{int(in_a_row)} optimizer steps in a row were skipped for a non-finite loss or gradient norm "
                f"(learner.max_skipped_steps={limit}); the run stopped with the weights of the last good step. "
                "Look for a reward beyond reward.max_abs or a learning rate too high (learner.lr); the warnings "
                "are in logs/train.log")

    async def _run(self) -> Dict[str, float]:
        try:
            return await self._train()
        finally:
            await self.workflow.close()  # an agent's chat server, on this event loop

    async def _train(self) -> Dict[str, float]:
        cfg = self.cfg.trainer
        await asyncio.gather(*(e.open_timeline(str(self.run_dir)) for e in self.components.remote_engines))
        await self.engine.set_sampling_state(self._engine_sampling_state)
        await self.sync_weights()  # the engine starts from the learner's (initial or resumed) weights
        history: List[Dict[str, float]] = self.context.metrics.history()
        last = [time.perf_counter(), 0]  # wall time and engine tokens at the previous step

        async def on_step(step: int, metrics: Dict[str, float], batch) -> None:
            now = time.perf_counter()
            interval = max(now - last[0], 1e-9)
            gen_tokens, train_tokens = self.tokens([t for g in batch for t in g.trajectories])
            engine_tokens = self.engine.stats.tokens
            metrics.update({
                "time/step_s": interval,
                "perf/step_tokens_per_s": (gen_tokens + train_tokens) / interval,
                # Everything the engine generated since the last step, including rollouts
                # that will train later (or be returned).
                "perf/generate_tokens_per_s": (engine_tokens - last[1]) / interval,
                "perf/train_tokens_per_s": train_tokens / max(metrics["time/train_s"], 1e-9),
                "queue/retry": float(len(self.ledger.retry_queue)),
                "queue/buffered_groups": float(len(self.ledger.buffer)),
                "queue/running_groups": float(self.ledger.in_flight),
                "queue/returned_total": float(self.ledger.counts["returned"]),
                "queue/returned_stale_total": float(self.ledger.counts["returned_stale"]),
                "queue/filtered_total": float(self.ledger.counts["filtered"]),
                "engine/busy_fraction": self.engine.stats.compute_s / max(now - self.started, 1e-9),
                **self._engine_counters.since_last(self.engine.stats),
                **self._sync_metrics,
                **self.context.gpu_telemetry.step_metrics(),
            })
            last[0], last[1] = now, engine_tokens
            self._eval_s = 0.0
            await self.after_step(step, metrics, history, progress)
            last[0] += self._eval_s  # the next step's time and throughput leave validation out

        self.started = time.perf_counter()
        ran = self.start_step <= cfg.total_steps
        with Progress(cfg.total_steps, enabled=cfg.progress, start=self.start_step - 1) as progress:
            try:
                if ran:
                    await self.controller.run(cfg.total_steps, on_step, first_step=self.start_step)
            except (StopRequested, RolloutsStopped):
                # Stopped on request (checkpoint written) or an engine is gone: rollouts still
                # running are aborted and return their prompts, then the engines are released.
                try:
                    await self.engine.abort()
                except EngineError:
                    pass  # the engine that failed; its requests have failed already
                await self.controller.drain()
                await self.engine.shutdown()
                raise
            await self.engine.abort()
            await self.controller.drain()
        if cfg.save_final_checkpoint and ran:
            await self.save(cfg.total_steps)
        await self.engine.shutdown()
        return summarize(history)

    def run(self) -> Dict[str, float]:
        finished = False
        try:
            summary = asyncio.run(self._run())
            finished = True
        finally:
            self.log_ledger()
            # After a failure the learner thread may be stuck in a collective with a dead rank.
            self.components.close(finished)
            self.context.close(finished)
        logger.info("done: reward %.3f (first steps) -> %.3f (last steps); run dir %s",
                    summary["reward_first"], summary["reward_last"], self.run_dir)
        return summary


    def log_ledger(self) -> None:
        """Where every admitted prompt ended: a person (or a test) reads that none was lost."""
        c, ledger = self.ledger.counts, self.ledger
        logger.info("prompt ledger: %d admitted = %d consumed + %d returned + %d filtered + %d running + %d buffered "
                    "(%s)", c["admitted"], c["consumed"], c["returned"], c["filtered"], ledger.in_flight,
                    len(ledger.buffer), "balanced" if ledger.balanced() else "NOT balanced")


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
