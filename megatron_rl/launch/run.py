"""One RL job over a torchrun world: every rank takes its role from the placement plan.

- **driver** (rank 0, a learner rank): composes the run with the same root as a one-process run
  (``megatron_rl/build.py``) and runs the same ``Trainer``: data, the staleness-bounded
  controller, rewards, metrics, checkpoints. It reaches every engine through a ``RemoteEngine``
  (the RolloutEngine interface over TCP) and the other learner ranks through a ``LearnerGroup``.
- **learner ranks**: build the same ``LearnerWorker`` and replay the driver's learner calls
  (train, send weights, save, resume), so Megatron's TP/PP/EP/DP collectives meet.
- **engine ranks** (disaggregated): serve the engine that ``rollout.engine``'s registry entry
  builds on an engine rank (rollout/build.py); new weights come over the weight-sync groups,
  received on a thread while the engine keeps generating, and are swapped in whole (pause(keep),
  load, resume), or, for an entry whose weights come by channel (vLLM), through its workers.
- **colocated**: every learner rank also hosts an engine (the entry's ``on_learner_rank``: for
  the embedded engine a child process), served to the driver the same way; weights are gathered
  on each rank and loaded through shared memory.

Groups: Megatron's learner layout, the weight-sync groups, and a gloo control group of the
learner ranks that carries the driver's calls. Every group is made with
``trainer.rank_timeout_s``: a rank that stops answering fails the run instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..config.schema import RootConfig
from ..process_groups import new_groups
from .groups import init_split_parallel_state
from ..placement import Plan

logger = logging.getLogger(__name__)

DRIVER = 0


def run_split_world(cfg: RootConfig, plan: Plan) -> Optional[Dict[str, float]]:
    """Every rank of the world calls this; the driver returns the run's summary."""
    from ..data.build import build_data
    from ..models.pretrained import check_vocabulary, vocab_size_for
    from ..build import seed_everything
    from ..rollout.build import CHANNEL, engine_entry

    lc = cfg.learner
    timeout = timedelta(seconds=cfg.trainer.rank_timeout_s)
    colocated = plan.layout.placement == "colocated"
    role = init_split_parallel_state(len(plan.learner_ranks), lc.tp, lc.pp, lc.ep, lc.cp,
                                     engine_tp=cfg.rollout.tp, seed=cfg.trainer.seed, timeout=timeout)
    host = _host(plan)
    sync, channels = (None, []) if colocated else _weight_sync(cfg, plan, role, host)
    control, = new_groups([plan.learner_ranks], backend="gloo", timeout=timeout)
    authkey = _shared_key()
    rank = dist.get_rank()
    # The same random stream as a one-process run up to the learner's initial weights.
    seed_everything(cfg.trainer.seed)
    tokenizer, prompts = build_data(cfg)
    check_vocabulary(cfg, tokenizer.vocab_size)
    vocab = vocab_size_for(cfg.model, tokenizer.vocab_size, lc.tp)
    if role == "engine":
        me = plan.ranks[rank]
        if engine_entry(cfg).weights == CHANNEL:
            _serve_channel_engine_rank(cfg, plan, vocab, sync, host, authkey, me.engine or 0,
                                       me.engine_member or 0)
        else:
            _serve_engine_rank(cfg, plan, vocab, sync, host, authkey, me.engine or 0)
        return None

    from ..learner.group import LearnerGroup, serve_learner
    from ..learner.worker import LearnerWorker
    from ..stop import install_stop_handlers
    from ..weights.transport_registry import learner_sender

    install_stop_handlers()  # a stop signal to any learner rank stops the run after its step

    hosted = _HostedEngine(cfg, vocab, host, authkey) if colocated else None
    ranks = _all_gather_ranks(role, hosted.listener.address if hosted else None,
                              hosted.engine_pid if hosted else None, channels)
    if hosted:
        hosted.serve()
    local = (hosted.engine, hosted.loop) if hosted else None
    sender = learner_sender(cfg.rollout.engine, plan.layout.placement, local if hosted else sync,
                            adapters=plan.layout.engine_adapters)
    worker = LearnerWorker(cfg, vocab, tokenizer.pad_id, weights_sender=sender, local_engine=local)
    try:
        if rank != DRIVER:
            serve_learner(worker, control)
            return None
        return _drive(cfg, plan, worker, LearnerGroup(worker, control, plan.learner_ranks), ranks, authkey,
                      (tokenizer, prompts))
    finally:
        if hosted:
            hosted.close()


def _drive(cfg: RootConfig, plan: Plan, worker, learners, ranks: List[Dict], authkey: bytes,
           data) -> Dict[str, float]:
    """The driver: the same composition root and Trainer as one process, given what the ranks built."""
    from ..build import WorldRanks, build_trainer

    return build_trainer(cfg, WorldRanks(worker, learners, data, ranks, authkey), plan).run()


def _weight_sync(cfg: RootConfig, plan: Plan, role: str, host: str):
    """Disaggregated: how the learners' weights reach the engine ranks. Embedded engines are
    ranks of the world and receive over its groups (collective: every rank builds them). vLLM's
    workers are processes of vLLM's own, so each stage's source hosts a weight channel they join;
    returns (this rank's sync groups, the channel addresses it hosts)."""
    from ..rollout.build import CHANNEL, engine_entry
    from ..weights.sync import SyncTopology, build_channel_groups, build_sync_groups

    topology = SyncTopology(plan.sync_sources, plan.engine_ranks)
    timeout = timedelta(seconds=cfg.trainer.rank_timeout_s)
    if engine_entry(cfg).weights != CHANNEL:
        return build_sync_groups(topology, timeout), []
    if plan.layout.engine_adapters:
        # vLLM serving a LoRA learner's adapters: each engine's hosting rank takes every push (the
        # base once, then the adapters) into host memory over gloo groups of the world and loads
        # its engine (weights/adapter_sync.py); collective, every rank builds them.
        hosts = tuple(group[0] for group in plan.engine_groups)
        return build_sync_groups(SyncTopology(plan.sync_sources, hosts), timeout, host_memory=True), []
    if role != "learner":
        return None, []
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # Members: each stage's source, then every vLLM worker (engine e's TP rank t is 1 + e*tp + t).
    return build_channel_groups(topology, host, receivers=len(plan.engine_ranks), backend=backend,
                                timeout_s=cfg.rollout.weight_timeout_s)


# ---------------------------------------------------------------------------- engine ranks
def _rank_cores(cfg: RootConfig, plan: Plan) -> int:
    """Intra-op threads of an engine rank's engine: this node's cores (the job's allocation, like
    every rank's) shared among the node's ranks."""
    from ..lifetime import available_cores

    return max(1, (cfg.trainer.cpu_threads or available_cores()) // plan.gpus_per_node)


def _serve_channel_engine_rank(cfg: RootConfig, plan: Plan, vocab: int, sync, host: str, authkey: bytes,
                               engine_index: int, member: int) -> None:
    """An engine whose entry's weights come by CHANNEL (vLLM): the first rank of an engine's
    ``rollout.tp`` ranks hosts it (its engine core and workers are processes of its own, on the
    GPUs of all the engine's ranks), served to the driver like any engine. Its workers join the
    learners' weight channels and receive each version while the engine keeps generating. The
    engine's other ranks only lend their GPU. Under lora.sync=adapters this rank's own process
    takes each push over the world's groups instead and loads its engine with it (the base
    through vLLM's own weight channel, the adapters as its LoRA)."""
    from ..rollout.build import engine_entry
    from ..rollout.remote import EngineListener
    from ..rollout.serve import EngineServer
    from ..weights.transport_registry import engine_receiver
    from ..weights.transports import ChannelLinks

    entry = engine_entry(cfg)
    if entry.first_rank_hosts and member != 0:
        _all_gather_ranks("engine")
        return
    _leave_stops_to_the_driver()
    r = cfg.rollout
    group = plan.engine_groups[engine_index]
    gpus = [plan.ranks[g].local_rank for g in group] if torch.cuda.is_available() else None
    engine = entry.on_engine_rank(cfg, vocab, cfg.trainer.seed + 1 + engine_index, _rank_cores(cfg, plan), gpus)
    listener = EngineListener(host, authkey)
    everyone = _all_gather_ranks("engine", listener.address, (engine.pids() or [None])[0])
    addresses = [a for _, a in sorted((stage, tuple(a)) for info in everyone for stage, a in info["channels"])]
    timeline = _RankTimeline()
    if plan.layout.engine_adapters:
        # The pushes come to this rank over the world's groups (``_weight_sync``), not to the workers.
        receive = engine_receiver("vllm", engine, sync, timeline.span, adapters=True)
    else:
        receive = engine_receiver("vllm", engine, ChannelLinks(tuple(addresses), 1 + engine_index * r.tp),
                                  timeline.span)
    conn = listener.accept()
    try:
        asyncio.run(EngineServer(conn, engine, extra={"receive_weights": receive, "open_timeline": timeline.open}).run())
    finally:
        engine.kill()  # the server shut it down, unless it failed on the way: no vLLM process stays


def _serve_engine_rank(cfg: RootConfig, plan: Plan, vocab: int, sync, host: str, authkey: bytes,
                       engine_index: int) -> None:
    """An engine rank: the engine its entry builds on an engine rank (the embedded engine, in
    this rank's process), served to the driver until it says shutdown (or its connection
    closes); weights arrive over the world's weight-sync groups. It stops only when the driver
    stops it: a stop signal is the driver's to act on (it checkpoints after the step, which
    needs the engines)."""
    from ..rollout.build import engine_entry
    from ..rollout.remote import EngineListener
    from ..rollout.serve import EngineServer
    from ..weights.transport_registry import engine_receiver

    _leave_stops_to_the_driver()
    # Each engine samples with its own stream of random numbers (unless seeded by request).
    engine = engine_entry(cfg).on_engine_rank(cfg, vocab, cfg.trainer.seed + 1 + engine_index,
                                              _rank_cores(cfg, plan), None)
    listener = EngineListener(host, authkey)
    _all_gather_ranks("engine", listener.address, (engine.pids() or [None])[0])
    timeline = _RankTimeline()
    receive = engine_receiver("embedded", engine, sync, timeline.span,
                              adapters=plan.layout.engine_adapters)
    conn = listener.accept()
    asyncio.run(EngineServer(conn, engine, extra={"receive_weights": receive, "open_timeline": timeline.open}).run())


def _leave_stops_to_the_driver() -> None:
    """An engine rank stops only when the driver stops it: a stop signal is the driver's to act
    on (it checkpoints after the step, which needs the engines)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: logger.info(
        "engine rank: SIGTERM noted; the driver decides when to stop (it checkpoints after the step)"))


class _RankTimeline:
    """An engine rank's spans (weight receive, swap) in the run's timeline, from the moment the
    driver names the run directory (``open``, served as the ``open_timeline`` call)."""

    def __init__(self) -> None:
        self._timeline = None

    async def open(self, run_dir: str) -> None:
        from ..telemetry.metrics import Timeline

        self._timeline = Timeline(Path(run_dir) / "timeline.jsonl", rank=dist.get_rank())

    def span(self, name: str, **attrs):
        return self._timeline.span(name, **attrs) if self._timeline is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------- colocated
class _HostedEngine:
    """Colocated placement: this learner rank's engine, the one its entry builds on a learner
    rank, served to the driver from an event loop on a thread of this rank, beside the learner
    that loads its weights: an embedded engine in a child process (its own interpreter, on this
    rank's GPU), or vLLM (whose engine core is a process of its own; its worker joins a weight
    channel this rank hosts, and sleeps while the learner trains at η = 0 -- a no-op on CPUs)."""

    def __init__(self, cfg: RootConfig, vocab: int, host: str, authkey: bytes):
        from ..rollout.build import engine_entry
        from ..rollout.remote import EngineListener

        seed = cfg.trainer.seed + 1 + dist.get_rank()
        # this rank's GPU (the child would otherwise start on cuda:0)
        gpu = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.engine = engine_entry(cfg).on_learner_rank(cfg, vocab, seed, 1, None if gpu is None else [gpu])
        self.engine_pid = (self.engine.pids() or [None])[0]
        self.listener = EngineListener(host, authkey)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hosted-engine", daemon=True)
        self._thread.start()
        self._served = None

    def serve(self) -> None:
        from ..rollout.serve import EngineServer

        async def serve() -> None:
            conn = await asyncio.get_running_loop().run_in_executor(None, self.listener.accept)
            await EngineServer(conn, self.engine).run()

        self._served = asyncio.run_coroutine_threadsafe(serve(), self.loop)

    def close(self) -> None:
        if self._served is not None:
            try:
                self._served.result(timeout=60)  # the driver's shutdown ends the server
            except Exception as err:  # noqa: BLE001 - closing: say it, do not mask the run's error
                logger.warning("hosted engine server: %r", err)
        asyncio.run_coroutine_threadsafe(self.engine.shutdown(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# ---------------------------------------------------------------------------- helpers
def _shared_key() -> bytes:
    """An authentication key for the driver's engine connections, drawn on rank 0."""
    box = [os.urandom(16) if dist.get_rank() == DRIVER else None]
    dist.broadcast_object_list(box, src=DRIVER, group=dist.group.WORLD)
    return box[0]


def _all_gather_ranks(role: str, engine_address=None, engine_pid: Optional[int] = None,
                      channels: Sequence = ()) -> List[Dict]:
    """What every rank is, where its engine listens and which weight channels it hosts (the
    driver writes it to the run directory's world.json: which process is which, for a person
    chasing a rank)."""
    mine = {"rank": dist.get_rank(), "role": role, "host": socket.gethostname(), "pid": os.getpid(),
            "engine_address": engine_address, "engine_pid": engine_pid,
            "channels": [(stage, a.as_tuple()) for stage, a in channels]}
    everyone: List = [None] * dist.get_world_size(group=dist.group.WORLD)
    dist.all_gather_object(everyone, mine, group=dist.group.WORLD)
    return everyone


def _host(plan: Plan) -> str:
    """Where this rank's engine listens: loopback when the world is one node, else this host's
    name (``MEGATRON_RL_ENGINE_HOST`` overrides, e.g. the address of a fast interface)."""
    if "MEGATRON_RL_ENGINE_HOST" in os.environ:
        return os.environ["MEGATRON_RL_ENGINE_HOST"]
    return "127.0.0.1" if plan.world_size <= plan.gpus_per_node else socket.gethostname()
