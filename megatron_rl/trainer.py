"""Wires data, engines, rewards and learners into a run: the driver of every placement.

One step: G samples per prompt → rewards → group advantages → train → push the new weights to
the engines, all through the staleness-bounded controller (scheduler/controller.py), the one
loop there is: rollouts overlap training under η, and η = 0 is the synchronous on-policy loop
(one batch generated per version). Every step leaves metrics, timeline spans and logs in the
run directory; the last step leaves a checkpoint."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .checkpoint.resume import CountingIterator, capture_rng, restore_rng
from .config.schema import RootConfig
from .errors import ConfigError
from .data.build import build_data
from .data.datasets import Prompt
from .learner.group import LearnerGroup, LearnerRanksFailed
from .lifetime import available_cores
from .learner.worker import LearnerWorker
from .models.gpt import model_device
from .models.pretrained import vocab_size_for
from .plugins import PluginError
from .rewards import RewardRunner, score_groups
from .rewards.runner import RewardFailing
from .rewards.user import build_reward
from .rollout.device import resolve_engine_device
from .rollout.build import engine_entry
from .rollout.embedded.engine import bind_thread_to_device
from .rollout.agent import AgentError, agent_metrics, runs
from .learner.recipes import recipe_for
from .learner.teachers import check_row_teachers, row_teacher
from .rollout.dataset_responses import DatasetResponses
from .rollout.workflow import build_workflow
from .rollout.engine import EngineError, RolloutEngine, failure_within, whole_response
from .scheduler.controller import AsyncController, GroupFailed, RolloutsStopped
from .scheduler.ledger import FinishedGroup, PromptLedger, Ticket, max_ahead_groups
from .scheduler.staleness import StalenessManager
from .stop import StopRequested, StopWatch, uninstall_stop_handlers
from .telemetry.gpu import GpuTelemetry
from .telemetry.metrics import MetricsWriter, Timeline, TrainedBatches, forget_spans_after
from .telemetry.trackers import open_trackers
from .telemetry.progress import Progress
from .telemetry.run_dir import make_run_dir, setup_logging
from .types import SamplingParams, Trajectory
from .weights.transport import BroadcastTransport, ColocatedTransport, InProcessTransport

logger = logging.getLogger(__name__)

# How long a failed weight sync waits for an engine to report that it died (two health probes of
# a vLLM engine) before it is taken for a failure of its own.
ENGINE_REPORT_GRACE_S = 10.0


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def compute_threads(cfg: RootConfig, overlap: bool) -> Tuple[Optional[int], int]:
    """Intra-op threads for this process (None: torch's default) and for an engine process.

    On a CPU, a learner and an engine that compute at once (rollouts overlapping training) each
    get half of ``trainer.cpu_threads`` cores: two OpenMP teams of the full size spin against each
    other and run ~2.5x slower (measured on 2 cores). In one process the half is shared (torch's
    setting is process-wide); an engine in its own process leaves the learner the other half.
    On GPU this process keeps torch's default unless ``trainer.cpu_threads`` is set."""
    cores = cfg.trainer.cpu_threads or available_cores()
    engine = max(1, cores // 2) if overlap else cores
    if torch.cuda.is_available():
        return cfg.trainer.cpu_threads or None, engine
    if not overlap:
        return cores, engine
    own_process = cfg.rollout.separate_process or engine_entry(cfg).own_process  # vLLM's core always is
    return (cores - cores // 2 if own_process else engine), engine


def engine_gpu(cfg: RootConfig) -> Optional[int]:
    """``rollout.device`` on this machine: the GPU of the engine process (None: the default).
    A GPU the machine lacks is a ConfigError, raised before the learner is built."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        return resolve_engine_device(cfg.rollout.device, gpus)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def build_engine(cfg: RootConfig, vocab: int, overlap: bool, learner_executor: ThreadPoolExecutor,
                 engine_threads: int, device_index: Optional[int] = None) -> RolloutEngine:
    """The engine that ``rollout.engine`` names, from its builder in rollout/build.py."""
    return engine_entry(cfg).build(cfg, vocab, overlap, learner_executor, engine_threads, device_index)


def uses_sandbox(cfg: RootConfig) -> bool:
    """Whether the run executes model-written programs: the code reward, or an agent whose tools
    run code (its ``uses_sandbox`` attribute)."""
    if cfg.reward.fn is None and cfg.reward.name == "code":
        return True
    from .plugins import is_import_path, load_object
    from .rollout.workflow import AGENTS, is_agent

    name = cfg.rollout.workflow
    if not is_agent(name):
        return False
    try:
        agent = load_object(name, what="rollout.workflow") if is_import_path(name) else AGENTS.get(name)
    except (ValueError, ImportError):
        return False  # build_workflow reports it
    return bool(getattr(agent, "uses_sandbox", False))


def prepare_sandbox(cfg: RootConfig) -> Optional[str]:
    """For a run that executes model-written programs: the code sandbox set up from
    ``cfg.sandbox`` and its mode in use written back into ``cfg.sandbox.mode`` (None otherwise).
    ConfigError (one line) when the sandbox cannot run them or may not in the mode it has."""
    if not uses_sandbox(cfg):
        return None
    from .rewards.sandbox import SandboxUnavailable, configure

    sc = cfg.sandbox
    try:
        sc.mode = configure(sc.mode, sc.allow_weak_isolation, sc.python)
    except SandboxUnavailable as err:
        raise ConfigError(str(err)) from None
    return sc.mode


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


@dataclass
class WorldPlacement:
    """What a torchrun world hands its driver (rank 0): the learner ranks and the engines as they
    were placed (``launch/run.py``). One process builds its own instead."""
    worker: LearnerWorker
    learners: LearnerGroup
    engine: RolloutEngine                   # the engines, one pool
    data: Tuple[Any, Any]                   # (tokenizer, prompt stream), built before the learner
    colocated: bool = False
    remote_engines: List[Any] = field(default_factory=list)  # disaggregated: the engines to sync
    table: str = ""                         # the placement plan, for the log
    ranks: List[Dict[str, Any]] = field(default_factory=list)  # role, host, pid of every rank


class Trainer:
    """The driver of a run, the same in every placement: data, engines, rewards, the
    staleness-bounded controller, metrics, checkpoints. Learner work goes through
    ``self.learners`` (every learner rank runs it) on the learner thread; weights reach the
    engines through ``self.transport``."""

    def __init__(self, cfg: RootConfig, world: Optional[WorldPlacement] = None):
        self.cfg = cfg
        # A GPU the machine lacks is refused before anything is built or written.
        device_index = engine_gpu(cfg) if world is None else None
        # So is a code sandbox that does not wall model-written programs off (resolved into
        # config.yaml's sandbox.mode).
        sandbox_mode = prepare_sandbox(cfg)
        self.run_dir = make_run_dir(cfg)
        setup_logging(self.run_dir / "logs" / "train.log")
        if sandbox_mode:
            from .rewards.sandbox import STRONG_MODES, describe

            logger.log(logging.INFO if sandbox_mode in STRONG_MODES else logging.WARNING, describe(sandbox_mode))
        # The learner computes on this thread, bound to this process's device (CUDA's is per thread).
        self.learner_executor = ThreadPoolExecutor(1, thread_name_prefix="learner", initializer=bind_thread_to_device,
                                                   initargs=(model_device(),))
        overlap = cfg.scheduler.max_staleness > 0
        if world is None:
            learner_threads, engine_threads = compute_threads(cfg, overlap)
            if learner_threads:
                torch.set_num_threads(learner_threads)
            seed_everything(cfg.trainer.seed)
            self.tokenizer, prompts = build_data(cfg)
            try:
                vocab = vocab_size_for(cfg.model, self.tokenizer.vocab_size, cfg.learner.tp)
            except ValueError as err:  # a tokenizer larger than the checkpoint's vocabulary
                raise ConfigError(str(err)) from None
            self.worker = LearnerWorker(cfg, vocab, self.tokenizer.pad_id)
            self.learners = LearnerGroup(self.worker)
            self.engine = build_engine(cfg, vocab, overlap, self.learner_executor, engine_threads, device_index)
            self.transport = InProcessTransport(self.engine, self.worker)
        else:
            self.tokenizer, prompts = world.data
            self.worker, self.learners, self.engine = world.worker, world.learners, world.engine
            self.transport = (ColocatedTransport(self.run_on_learners) if world.colocated
                              else BroadcastTransport(world.remote_engines, self.run_on_learners))
            self.learners.call("open_timeline", str(self.run_dir))
            logger.info("torchrun world:\n%s", world.table)
            (self.run_dir / "world.json").write_text(json.dumps({"plan": world.table, "ranks": world.ranks}, indent=1))
        # tokenizer.json with the tokenizer_config.json / generation_config.json that tell transformers
        # its EOS and PAD: the run directory is the tokenizer directory of its checkpoints.
        self.tokenizer.save_pretrained(self.run_dir)
        check_row_teachers(prompts, cfg.teacher)  # several teachers: each row names one
        # Counted, so that a resumed run skips what the checkpointed run had drawn.
        self.prompts = CountingIterator(prompts)
        r = cfg.rollout
        # With rollout.seed_by_request each request samples from its own random stream (seeded
        # by the run's seed and its id), so its tokens do not depend on the engine serving it.
        self.params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens,
                                     stop_token_ids=self.tokenizer.stop_ids, stream=False,
                                     seed=cfg.trainer.seed if r.seed_by_request else None)
        try:
            if recipe_for(cfg.algo.name).samples_from_data:  # SFT: the rows' own responses
                self.workflow = DatasetResponses(self.tokenizer, lambda: self.version)
            else:
                self.workflow = build_workflow(r.workflow, self.tokenizer, cfg.model.max_position_embeddings,
                                               r.turn_discount, r.agent_args)
        except ValueError as err:  # e.g. an agent with a tokenizer that has no chat template
            raise ConfigError(str(err)) from None
        self.timeline = Timeline(self.run_dir / "timeline.jsonl")
        self._remote_engines = [] if world is None else world.remote_engines
        self.samples = (self.run_dir / "samples.jsonl").open("a", buffering=1)
        self.version = 0
        self._engine_prev = copy.copy(self.engine.stats)
        self._sync_metrics: Dict[str, float] = {}
        sc = cfg.scheduler
        self.ledger = PromptLedger(self.prompts, StalenessManager(
            sc.max_staleness, cfg.algo.groups_per_batch, sc.max_concurrent_rollouts),
            max_ahead_groups=max_ahead_groups(sc.max_ahead_batches, cfg.algo.groups_per_batch),
            filter_equal_rewards=cfg.algo.filter_groups)
        self.controller = AsyncController(self.ledger, self.rollout_group, self.train_groups, self.publish,
                                          train_executor=self.learner_executor,
                                          max_filtered_batches=cfg.algo.filter_max_batches)
        self.stop_watch = StopWatch(self.run_dir)
        self.start_step = 1
        self._engine_sampling_state: Optional[bytes] = None
        self.rewards = self.build_rewards()  # its worker processes start now, in the background
        # trainer.eval_interval: the eval sets, tokenized once; scored with this engine between steps.
        self.evaluator = None
        if cfg.trainer.eval_interval:
            from .eval_sets import EvalSuite

            try:
                self.evaluator = EvalSuite(cfg, self.tokenizer)
            except BaseException:
                self.rewards.close()
                raise
        self._eval_s = 0.0
        if cfg.trainer.resume:
            try:
                self.resume()  # last: the random states it restores must not be consumed by set-up
            except BaseException:
                self.rewards.close()
                raise
        # Rows and TensorBoard events of steps after the checkpoint (a run that died past it) are
        # dropped; W&B and MLflow continue the run's own run (trainer.loggers).
        try:
            trackers = open_trackers(cfg.trainer.loggers, self.run_dir, cfg.trainer.project, cfg.trainer.run_name,
                                     first_step=self.start_step)
        except BaseException:
            self.rewards.close()
            raise
        self.metrics = MetricsWriter(self.run_dir, first_step=self.start_step, trackers=trackers)
        # Per-step GPU utilisation, memory, power, clocks (telemetry/gpu.py); empty without a GPU.
        self.gpu_telemetry = GpuTelemetry(cfg.trainer.gpu_telemetry_interval_s).start()
        self.trained = TrainedBatches(self.run_dir, first_step=self.start_step)
        logger.info("run directory: %s", self.run_dir)

    def build_rewards(self) -> RewardRunner:
        rc = self.cfg.reward
        reward_fn, reward_label = build_reward(rc)
        try:
            # A reward failing for every sample of a batch's worth of groups in a row is broken
            # (or its data is): the run stops naming it rather than training on fallback scores.
            return RewardRunner(reward_fn, rc.workers, rc.timeout_s, name=reward_label, fallback=rc.fallback,
                                min_value=rc.min_value, max_value=rc.max_value, max_abs=rc.max_abs,
                                max_failing_groups=self.cfg.algo.groups_per_batch)
        except PluginError as err:  # a reward the worker processes cannot be sent
            raise ConfigError(str(err)) from None

    async def run_on_learners(self, name: str, *args: Any) -> Any:
        """``LearnerWorker.<name>(*args)`` on every learner rank, from the learner thread (every
        call to the learner ranks is made there, so they arrive in one order)."""
        return await asyncio.get_running_loop().run_in_executor(self.learner_executor, self.learners.call, name, *args)

    # ------------------------------------------------------------------ pieces of a step
    async def sync_weights(self) -> None:
        self._sync_metrics = await self.transport.push(self.version)
        if self.cfg.rollout.check_sync:
            self._sync_metrics["sync/probe_gap"] = await self.probe_engines()

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
            self.samples.write(json.dumps({
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
        with self.timeline.span("train", step=step):
            metrics.update(self.learners.call("train", groups, version, lr_at(self.cfg, step), teachers))
        self.log_samples(step, prompts, groups)  # with the advantages the learner assigned
        return metrics

    def batch_metrics(self, groups: Sequence[Sequence[Trajectory]], train_version: int) -> Dict[str, float]:
        """Reward, length and staleness statistics of one training batch; rewards per run (an
        agent run of several trajectories counts once), lengths and staleness per trajectory."""
        flat = [t for grp in groups for t in grp]
        rewards = np.array([t.reward for t in runs(groups)])
        lengths = np.array([len(t.response_ids) for t in flat])
        staleness = np.array([train_version - t.oldest_version for t in flat if t.versions])
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

    def engine_metrics(self) -> Dict[str, float]:
        """Engine counters since the previous call: batches built and decode steps, and the mean
        number of running rows per decode step (continuous batching keeps it up)."""
        st, prev = self.engine.stats, self._engine_prev
        steps = st.decode_steps - prev.decode_steps
        out = {
            "engine/prefills": float(st.prefills - prev.prefills),
            "engine/admissions": float(st.admissions - prev.admissions),
            "engine/decode_steps": float(steps),
            "engine/rows_per_decode": (st.decode_rows - prev.decode_rows) / steps if steps else 0.0,
            # Where the engine's compute time went since the last step.
            **{f"engine/{kind}_s": getattr(st, f"{kind}_s") - getattr(prev, f"{kind}_s")
               for kind in ("prefill", "admit", "decode")},
        }
        self._engine_prev = copy.copy(st)
        return out

    def tokens(self, flat: Sequence[Trajectory]) -> Tuple[int, int]:
        """(generated tokens, trained tokens) of a batch."""
        generated = sum(len(t.response_ids) for t in flat)
        return generated, generated + sum(len(t.prompt_ids) for t in flat)

    # ------------------------------------------------------------------ asynchronous pieces
    async def rollout_group(self, ticket: Ticket) -> List[Trajectory]:
        """G samples of one prompt, scored; an aborted sample fails the group (prompt retried)."""
        g, p = self.cfg.algo.group_size, ticket.prompt
        with self.timeline.span("generate", group=ticket.index):
            try:
                trajs = await self.workflow(self.engine, p, self.params,
                                            [f"g{ticket.index}-{p.uid}-{i}" for i in range(g)])
            except EngineError:
                self._raise_if_engine_gone()
                raise
            except AgentError as err:  # the agent broke its contract, and every run would: stop
                raise RolloutsStopped(str(err)) from None
        aborted = sum(t.finish_reason == "abort" for t in trajs)
        if aborted:
            raise GroupFailed(f"{aborted} of {g} samples aborted")
        trajs = list(trajs)
        if not self.workflow.sets_rewards:  # agents return their runs' rewards
            with self.timeline.span("reward", group=ticket.index):
                try:
                    await self.score([p], [trajs])
                except (PluginError, RewardFailing) as err:  # every group would fail the same way: stop
                    raise RolloutsStopped(str(err)) from None
        return trajs

    def train_groups(self, groups: List[FinishedGroup], version: int) -> Dict[str, float]:
        """Runs on the learner thread while rollouts continue."""
        metrics = self.train_on([g.ticket.prompt for g in groups], [g.trajectories for g in groups], version)
        self.trained.write(version + 1, version, groups)
        return metrics

    async def publish(self, version: int) -> None:
        with self.timeline.span("sync", version=version):
            self.version = version
            try:
                await self.sync_weights()
            except (EngineError, LearnerRanksFailed):
                # The learners' side of a broadcast may fail first when an engine dies: its death,
                # once reported, is the cause to name.
                self._raise_if_engine_gone(await failure_within(self.engine, ENGINE_REPORT_GRACE_S))
                raise

    def _raise_if_engine_gone(self, failure: Optional[str] = None) -> None:
        failure = failure or self.engine.failure
        if failure:
            raise RolloutsStopped(f"the rollout engine is gone ({failure}); the prompts it held were "
                                  "returned to the queue and the run stopped. Its last words are in "
                                  "logs/train.log") from None

    # ------------------------------------------------------------------ checkpoints
    def resume(self) -> None:
        """Continue from the newest loadable checkpoint of this run directory, if there is one:
        weights and optimizers, random states, the position in the prompt stream, the policy
        version and the prompts that were waiting or in flight (they are generated again)."""
        found = self.learners.call("resume", str(self.run_dir / "checkpoints"))
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
        with self.timeline.span("checkpoint", step=step):
            path = await self.run_on_learners("save", str(self.run_dir / "checkpoints"), step, state,
                                              "hf" if self.cfg.trainer.export_hf else None, str(self.run_dir))
            return Path(path)

    async def stop_requested(self) -> bool:
        """A stop signal or file on any learner rank (they all stop after the same step)."""
        return await self.run_on_learners("any_rank_asked", self.stop_watch.requested())

    # ------------------------------------------------------------------ the run
    async def after_step(self, step: int, metrics: Dict[str, float], history: List[Dict[str, float]],
                         progress: Progress) -> None:
        cfg = self.cfg.trainer
        if cfg.eval_interval and step % cfg.eval_interval == 0:
            metrics.update(await self.validate(step))
        history.append(metrics)
        self.metrics.write(step, metrics)
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
        with self.timeline.span("eval", step=step):
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
        await asyncio.gather(*(e.open_timeline(str(self.run_dir)) for e in self._remote_engines))
        await self.engine.set_sampling_state(self._engine_sampling_state)
        await self.sync_weights()  # the engine starts from the learner's (initial or resumed) weights
        history: List[Dict[str, float]] = self.metrics.history()
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
                "queue/filtered_total": float(self.ledger.counts["filtered"]),
                "engine/busy_fraction": self.engine.stats.compute_s / max(now - self.started, 1e-9),
                **self.engine_metrics(),
                **self._sync_metrics,
                **self.gpu_telemetry.step_metrics(),
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
            self.learners.close()  # the other learner ranks leave their loop
            self.metrics.close(finished)
            self.gpu_telemetry.close()
            self.trained.close()
            self.timeline.close()
            self.samples.close()
            self.rewards.close()
            if self.evaluator is not None:
                self.evaluator.close()
            # After a failure the learner thread may be stuck in a collective with a dead rank.
            self.learner_executor.shutdown(wait=finished)
            uninstall_stop_handlers()  # the run is over: a TERM from now on ends the process
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
