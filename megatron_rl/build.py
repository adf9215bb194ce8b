"""The composition root: ``build(cfg, plan, context)`` returns a run's ``Components`` -- data,
learners, engine(s), weight transport, workflow, rewards -- the same whatever the placement.

One process is a world of one rank: its learner and its engine (``rollout.engine``'s entry,
rollout/build.py) are built here. In a torchrun world every rank builds its learner worker
collectively and the engines are hosted on their ranks (launch/run.py, from the same entry);
the driver's ``build`` receives those (``WorldRanks``) and reaches each engine through a
``RemoteEngine``. ``Trainer`` receives the components and a ``RunContext`` and only drives.

This module is the top of the package's imports: nothing below imports it."""

from __future__ import annotations

import asyncio
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .checkpoint.resume import CountingIterator
from .components import Components, PolicyVersion, RunOnLearners
from .config.schema import RootConfig
from .data.build import build_data
from .errors import ConfigError
from .placement import Plan, plan_for
from .learner.group import LearnerGroup
from .learner.recipes import recipe_for
from .learner.teachers import check_row_teachers
from .learner.worker import LearnerWorker
from .lifetime import available_cores
from .models.gpt import model_device
from .models.pretrained import check_vocabulary, vocab_size_for
from .plugins import PluginError
from .rewards import RewardRunner
from .rewards.user import build_reward
from .rollout.build import engine_entry
from .rollout.dataset_responses import DatasetResponses
from .rollout.device import resolve_engine_device
from .rollout.embedded.engine import bind_thread_to_device
from .rollout.workflow import Workflow, build_workflow
from .telemetry.run_context import RunContext
from .models.lora import engine_applies_adapters, merged_fallback
from .weights.transport_registry import transport_for
from .weights.transports import Transport

if TYPE_CHECKING:
    from .trainer import Trainer

logger = logging.getLogger(__name__)


@dataclass
class WorldRanks:
    """What a torchrun world's ranks built before its driver composes the run: the driver's own
    learner worker, the group of every learner rank, the data (built before the learner, in the
    same random stream as one process), and every rank's role and engine address."""
    worker: LearnerWorker
    learners: LearnerGroup
    data: Tuple[Any, Any]                   # (tokenizer, prompt stream)
    ranks: List[Dict[str, Any]]             # role, host, pid, engine address of every rank
    authkey: bytes                          # for the driver's engine connections


# ---------------------------------------------------------------------------- set-up helpers
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


def open_run(cfg: RootConfig) -> Tuple[RunContext, Optional[int]]:
    """The run's context, and the engine's GPU (``rollout.device``, one process). A GPU the
    machine lacks, or a code sandbox that does not wall model-written programs off, is refused
    before anything is built or written; the sandbox's mode goes into config.yaml."""
    device_index = engine_gpu(cfg)
    sandbox_mode = prepare_sandbox(cfg)
    context = RunContext(cfg)
    if sandbox_mode:
        from .rewards.sandbox import STRONG_MODES, describe

        logger.log(logging.INFO if sandbox_mode in STRONG_MODES else logging.WARNING, describe(sandbox_mode))
    return context, device_index


def build_rewards(cfg: RootConfig) -> RewardRunner:
    """The reward (``reward.name`` or ``reward.fn``) in its worker pool; its processes start now,
    in the background."""
    rc = cfg.reward
    reward_fn, reward_label = build_reward(rc)
    try:
        # A reward failing for every sample of a batch's worth of groups in a row is broken
        # (or its data is): the run stops naming it rather than training on fallback scores.
        return RewardRunner(reward_fn, rc.workers, rc.timeout_s, name=reward_label, fallback=rc.fallback,
                            min_value=rc.min_value, max_value=rc.max_value, max_abs=rc.max_abs,
                            max_failing_groups=cfg.algo.groups_per_batch)
    except PluginError as err:  # a reward the worker processes cannot be sent
        raise ConfigError(str(err)) from None


def learner_caller(learners: LearnerGroup, executor: ThreadPoolExecutor) -> RunOnLearners:
    """``LearnerWorker.<name>(*args)`` on every learner rank, from the learner thread (every call
    to the learner ranks is made there, so they arrive in one order)."""
    async def run_on_learners(name: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, learners.call, name, *args)

    return run_on_learners


# ---------------------------------------------------------------------------- the root
def build(cfg: RootConfig, plan: Plan, context: RunContext, world: Optional[WorldRanks] = None,
          device_index: Optional[int] = None) -> Components:
    """The components of a run placed by ``plan``. ``world``: what the torchrun world's ranks
    built (None: one process, a world of one rank, whose learner and engine are built here).
    ``device_index``: the engine process's GPU in one process (``rollout.device``)."""
    # The learner computes on this thread, bound to this process's device (CUDA's is per thread).
    executor = ThreadPoolExecutor(1, thread_name_prefix="learner", initializer=bind_thread_to_device,
                                  initargs=(model_device(),))
    if world is None:
        tokenizer, prompts, worker, learners, engine = _one_process(cfg, executor, device_index)
        placement, remote = "one_process", []
    else:
        tokenizer, prompts = world.data
        worker, learners = world.worker, world.learners
        engine, remote = _world_engines(cfg, plan, world)
        placement = plan.layout.placement
        learners.call("open_timeline", str(context.dir))
        context.write_world(plan.table(), world.ranks)
    run_on_learners = learner_caller(learners, executor)
    transport = _transport(cfg, placement, remote or [engine], run_on_learners, worker)
    # tokenizer.json with the tokenizer_config.json / generation_config.json that tell transformers
    # its EOS and PAD: the run directory is the tokenizer directory of its checkpoints.
    tokenizer.save_pretrained(context.dir)
    check_row_teachers(prompts, cfg.teacher)  # several teachers: each row names one
    policy = PolicyVersion()
    workflow = _workflow(cfg, tokenizer, policy)
    rewards = build_rewards(cfg)
    evaluator = None
    if cfg.trainer.eval_interval:  # the eval sets, tokenized once; scored with this engine between steps
        from .eval_sets import EvalSuite

        try:
            evaluator = EvalSuite(cfg, tokenizer)
        except BaseException:
            rewards.close()
            raise
    return Components(tokenizer, CountingIterator(prompts), worker, learners, executor, run_on_learners, engine,
                      transport, workflow, rewards, policy, evaluator, remote)


def _one_process(cfg: RootConfig, executor: ThreadPoolExecutor, device_index: Optional[int]):
    """The learner and the engine of a one-process run, in the order that fixes its random
    stream (the torchrun world's ranks draw the learner's initial weights the same way)."""
    overlap = cfg.scheduler.max_staleness > 0
    learner_threads, engine_threads = compute_threads(cfg, overlap)
    if learner_threads:
        torch.set_num_threads(learner_threads)
    seed_everything(cfg.trainer.seed)
    tokenizer, prompts = build_data(cfg)
    check_vocabulary(cfg, tokenizer.vocab_size)
    try:
        vocab = vocab_size_for(cfg.model, tokenizer.vocab_size, cfg.learner.tp)
    except ValueError as err:  # a tokenizer larger than the checkpoint's vocabulary
        raise ConfigError(str(err)) from None
    worker = LearnerWorker(cfg, vocab, tokenizer.pad_id)
    engine = engine_entry(cfg).build(cfg, vocab, overlap, executor, engine_threads, device_index)
    return tokenizer, prompts, worker, LearnerGroup(worker), engine


def _transport(cfg: RootConfig, placement: str, engines: List[Any], run_on_learners: RunOnLearners,
               worker: Any) -> Transport:
    """How each new policy version reaches ``engines`` (weights/transports.py's registry): under
    LoRA with engines that apply the adapters unmerged, the base once and then the adapters
    alone (weights/adapter_sync.py); an engine that cannot is warned of once and takes merged
    weights."""
    fallback = merged_fallback(cfg, placement)
    if fallback:
        logger.warning(fallback)
    entry = transport_for(cfg.rollout.engine, placement, adapters=engine_applies_adapters(cfg))
    return entry.transport(engines, run_on_learners, cfg.rollout.weight_timeout_s, worker=worker)


def _world_engines(cfg: RootConfig, plan: Plan, world: WorldRanks):
    """The driver's view of the engines its ranks host: one ``RemoteEngine`` per engine (on its
    first rank, or on each learner rank when colocated) and one pool; and the engines a weight
    push must reach itself (disaggregated; colocated, the learner ranks load their own)."""
    from .rollout.pool import EnginePool
    from .rollout.remote import RemoteEngine

    colocated = plan.layout.placement == "colocated"
    heads = list(plan.learner_ranks) if colocated else [group[0] for group in plan.engine_groups]
    engines = [RemoteEngine(world.ranks[r]["engine_address"], world.authkey, r,
                            call_timeout_s=cfg.trainer.rank_timeout_s) for r in heads]
    pool = EnginePool(engines) if len(engines) > 1 else engines[0]
    return pool, ([] if colocated else engines)


def _workflow(cfg: RootConfig, tokenizer: Any, policy: PolicyVersion) -> Workflow:
    r = cfg.rollout
    try:
        if recipe_for(cfg.algo.name).samples_from_data:  # SFT: the rows' own responses
            return DatasetResponses(tokenizer, lambda: policy.value)
        return build_workflow(r.workflow, tokenizer, cfg.model.max_position_embeddings, r.turn_discount,
                              r.agent_args)
    except ValueError as err:  # e.g. an agent with a tokenizer that has no chat template
        raise ConfigError(str(err)) from None


def one_process_plan(cfg: RootConfig) -> Plan:
    """The placement of a one-process run: a world of one rank, learner and engine together."""
    return plan_for(cfg, 1, 1)


def build_trainer(cfg: RootConfig, world: Optional[WorldRanks] = None, plan: Optional[Plan] = None) -> "Trainer":
    """A run's driver: its context opened, its components built (``build``), handed to
    ``Trainer``. One process unless ``world`` (with its ``plan``) is given."""
    from .trainer import Trainer

    context, device_index = open_run(cfg)
    components = build(cfg, plan or one_process_plan(cfg), context, world, device_index)
    try:
        return Trainer(cfg, components, context)
    except BaseException:
        components.rewards.close()
        raise
