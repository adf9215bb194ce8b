"""How a new policy version reaches the engines: one protocol with three sides, and a registry of
transports keyed by engine kind and placement.

- **push** (the driver): ``await transport.push(version)`` returns once every engine holds
  ``version`` (each applies it whole: pause(keep), load, resume), with the push's figures
  (``SyncMetrics``). Engines keep generating with the version they hold while the new one
  travels. Work on the learner ranks goes through ``run_on_learners`` (the trainer's learner
  thread, where every call to the learner ranks is made).
- **send** (every learner rank): ``LearnerWorker.send_weights`` calls its ``Sender``: gather
  with the one export (``export.py``) and broadcast each stage (``BroadcastSender``), or load
  this rank's own engine (``LocalEngineSender``).
- **receive** (beside an engine, on an engine rank): ``engine_receiver`` gives the launcher the
  call it serves as ``receive_weights``.

What every push shares is written here once: a dead engine stops the push before it starts and
is named when the push fails (``rollout.engine.raise_if_gone``); a push that takes longer than
``rollout.weight_timeout_s`` fails; a receiver that gets another version than asked fails
(``check_version``).

Transports (engine kind, placement -> name: how the tensors travel):
- embedded or vllm, one_process -> in_process: ``engine.swap_weights`` (to an engine process
  through shared memory, a CUDA IPC handle on a GPU; vLLM: its own weight channel or file);
- embedded or vllm, colocated -> colocated: every learner rank gathers every stage and loads its
  own engine as in one process;
- embedded, disaggregated -> world_broadcast: buckets over groups of the torchrun world (``sync.py``);
- vllm, disaggregated -> vllm_channel: buckets over weight channels vLLM's workers join
  (``channel.py``).
A LoRA learner whose engines carry the adapters (embedded or vLLM) has an entry per placement in
``adapter_sync.py`` (the frozen base once, then the adapters alone; to a vLLM engine rank over the
world's groups, as to an embedded one).
"""

from __future__ import annotations

import abc
import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar, Dict, Optional, Sequence, Tuple, Type

from ..api.engine import EngineError, RolloutEngine, raise_if_gone, raise_if_gone_within

RunOnLearners = Callable[..., Awaitable]
Span = Callable[..., Any]  # span(name, **attrs): a context manager of the rank's timeline

# How long a failed push waits for an engine to report its death (the sending side of a
# broadcast can fail first, when its peer is gone; two health probes of a vLLM engine), so that
# the death is the cause named.
ENGINE_REPORT_GRACE_S = 10.0


def check_version(asked: int, got: int) -> None:
    """A receiver asked for ``asked`` got ``got``: anything else than the same is a broken push."""
    if int(got) != int(asked):
        raise EngineError(f"asked to receive weights v{asked}, the learners sent v{int(got)}")


@dataclass
class SyncMetrics:
    """A push's figures: its wall time, the slowest source's send and the slowest engine's
    receive where they are separate, and the engine's own figures (vLLM: bytes, seconds)."""
    seconds: float
    send_s: Optional[float] = None
    receive_s: Optional[float] = None
    engine: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, float]:
        out = {"sync/seconds": self.seconds, **self.engine}
        if self.send_s is not None:
            out["sync/send_s"] = self.send_s
        if self.receive_s is not None:
            out["sync/receive_s"] = self.receive_s
        return out


# ---------------------------------------------------------------------------- the driver's side
class Transport(abc.ABC):
    """The driver's side of a transport. ``engines``: the engines the push must reach (their
    ``failure`` names a dead one); ``timeout_s``: the longest a push may take;
    ``report_grace_s``: how long a failed push waits for an engine to report its death."""

    name: ClassVar[str]

    def __init__(self, engines: Sequence[RolloutEngine], run_on_learners: RunOnLearners, timeout_s: float,
                 worker: Any = None, report_grace_s: float = ENGINE_REPORT_GRACE_S):
        self.engines = list(engines)
        self.run_on_learners = run_on_learners
        self.timeout_s, self.report_grace_s = timeout_s, report_grace_s
        self.worker = worker  # one process: the learner worker whose weights go straight to the engine

    async def push(self, version: int) -> SyncMetrics:
        """Every engine holds ``version`` when this returns."""
        raise_if_gone(self.engines)  # a transfer to a dead engine would leave the others waiting in it
        start = time.perf_counter()
        try:
            metrics = await asyncio.wait_for(self._move(version), self.timeout_s)
        except asyncio.TimeoutError:
            await raise_if_gone_within(self.engines, self.report_grace_s)
            raise EngineError(f"weights v{version} did not reach the engines within {self.timeout_s:g} s "
                              "(rollout.weight_timeout_s); an engine or a learner rank is stuck") from None
        except RuntimeError:  # EngineError, LearnerRanksFailed: an engine's death is the cause to name
            await raise_if_gone_within(self.engines, self.report_grace_s)
            raise
        metrics.seconds = time.perf_counter() - start
        return metrics

    @abc.abstractmethod
    async def _move(self, version: int) -> SyncMetrics:
        """Carry ``version`` to every engine (``seconds`` is filled in by ``push``)."""


class InProcessTransport(Transport):
    """One process: the learner's full tensors go straight to its engine, through shared memory
    (CUDA IPC on a GPU) when the engine has a process of its own."""

    name = "in_process"

    async def _move(self, version: int) -> SyncMetrics:
        engine, = self.engines
        return SyncMetrics(0.0, engine=await engine.swap_weights(self.worker.hf_weights(), version) or {})


class ColocatedTransport(Transport):
    """Colocated: every learner rank gathers every stage's full tensors (pipeline stages go round
    the pipeline group as tensors) and loads its own engine."""

    name = "colocated"

    async def _move(self, version: int) -> SyncMetrics:
        await self.run_on_learners("send_weights", version)
        return SyncMetrics(0.0)


class BroadcastTransport(Transport):
    """Disaggregated: the learner ranks gather each pipeline stage's full tensors and broadcast
    them in buckets; each engine, asked to receive the version, takes the buckets while it keeps
    generating, then swaps them in whole."""

    name = "world_broadcast"

    async def _move(self, version: int) -> SyncMetrics:
        sent, *received = await asyncio.gather(self.run_on_learners("send_weights", version),
                                               *(e.receive_weights(version) for e in self.engines))
        received = [r for r in received if r is not None]
        # The slowest engine's receive (while it kept generating).
        return SyncMetrics(0.0, send_s=sent, receive_s=max(received) if received else None)


class ChannelTransport(BroadcastTransport):
    """Disaggregated vLLM: the same buckets, over weight channels that vLLM's workers join."""

    name = "vllm_channel"


# ---------------------------------------------------------------------------- the learners' side
class BroadcastSender:
    """Each stage's source broadcasts the stage's tensors over its link (world groups or weight
    channels); the other learner ranks help gather."""

    def __init__(self, groups):
        self.groups = groups

    def send(self, learner, version: int) -> Optional[float]:
        from .sync import send_weights

        stats = send_weights(learner.module, learner.cfg.model, self.groups, version)
        return stats.seconds if stats is not None else None


class LocalEngineSender:
    """Colocated: this rank's engine (a client on an event loop of this rank) loads every
    stage's full tensors."""

    def __init__(self, local: Tuple[RolloutEngine, asyncio.AbstractEventLoop]):
        self.engine, self.loop = local

    def send(self, learner, version: int) -> None:
        self._load_own_engine(list(learner.export_hf_weights()), version)
        return None

    def _load_own_engine(self, tensors, version: int) -> None:
        import torch.distributed as dist

        async def swap() -> None:
            await self.engine.wake_up()
            await self.engine.swap_weights(tensors, version)

        asyncio.run_coroutine_threadsafe(swap(), self.loop).result()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank's engine holds the version before the driver goes on


# ---------------------------------------------------------------------------- beside an engine
class WorldReceiver:
    """An embedded engine on an engine rank: the buckets arrive on a thread of their own while
    the engine keeps generating; then the version is swapped in whole."""

    def __init__(self, engine: RolloutEngine, groups, span: Span):
        self.engine, self.groups, self.span = engine, groups, span

    async def receive(self, version: int) -> float:
        from .sync import receive_weights

        with self.span("sync", version=version):
            got, tensors, stats = await in_daemon_thread(receive_weights, self.groups)
        check_version(version, got)
        with self.span("swap", version=version):
            await self.engine.swap_weights(tensors.items(), version)
        return stats.seconds


@dataclass(frozen=True)
class ChannelLinks:
    """Where a vLLM engine's workers join the learners' weight channels: the channels' addresses
    (one per pipeline stage) and the member number of the engine's first worker."""
    addresses: Tuple[Tuple, ...]
    first_member: int


class ChannelReceiver:
    """vLLM on an engine rank: its workers take the buckets from the channels while it keeps
    generating; then the version is swapped in whole."""

    def __init__(self, engine, links: ChannelLinks, span: Span):
        self.engine, self.links, self.span = engine, links, span

    async def receive(self, version: int) -> float:
        with self.span("sync", version=version):
            figures = await self.engine.receive_weights(self.links.addresses, self.links.first_member)
        check_version(version, figures["version"])
        with self.span("swap", version=version):
            await self.engine.apply_received(version)
        return figures["sync/engine_receive_s"]


def in_daemon_thread(fn, *args) -> "asyncio.Future":
    """``fn(*args)`` on a daemon thread: one blocked in a collective with a dead rank does not
    keep the process from exiting (an executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(lambda error=err: future.done() or future.set_exception(error))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=target, name="weight-receiver", daemon=True).start()
    return future


# ---------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class TransportEntry:
    """One way weights reach one kind of engine in one placement: its driver side, and where
    there is one, the kind of its learner side and of its receiver beside the engine."""
    transport: Type[Transport]
    sender: Optional[type] = None
    receiver: Optional[type] = None

    @property
    def name(self) -> str:
        return self.transport.name
