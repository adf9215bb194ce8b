"""Publishing a new policy version to the engines, one class per placement.

The controller calls ``await transport.push(version)`` after each learner step; it returns once
every engine holds ``version`` (each applies it whole: pause(keep), load, resume). Engines keep
generating with the version they hold while the new one travels. Learner-side work runs on the
trainer's learner thread (``run_on_learners``), where every call to the learner ranks is made.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Dict, Sequence

RunOnLearners = Callable[..., Awaitable]


class InProcessTransport:
    """One process: the learner's full tensors go straight to its engine (through shared memory
    when the engine has a process of its own)."""

    def __init__(self, engine, worker):
        self.engine, self.worker = engine, worker

    async def push(self, version: int) -> Dict[str, float]:
        start = time.perf_counter()
        await self.engine.swap_weights(self.worker.hf_weights(), version)
        # The engine's own figures, where it keeps them (vLLM: seconds and bytes of the transfer).
        return {"sync/seconds": time.perf_counter() - start, **getattr(self.engine, "last_sync", {})}


class BroadcastTransport:
    """Disaggregated: the learner ranks gather each pipeline stage's full tensors and broadcast
    them in buckets over the weight-sync groups; each engine rank, asked to receive the version,
    takes the buckets on a thread of its own while it keeps generating, then swaps them in."""

    def __init__(self, engines: Sequence, run_on_learners: RunOnLearners):
        self.engines = list(engines)
        self.run_on_learners = run_on_learners

    async def push(self, version: int) -> Dict[str, float]:
        from ..rollout.engine import EngineError

        for engine in self.engines:
            if engine.failure:  # a broadcast to a dead rank would leave the others waiting in it
                raise EngineError(engine.failure)
        start = time.perf_counter()
        sent, *received = await asyncio.gather(self.run_on_learners("send_weights", version),
                                               *(e.receive_weights(version) for e in self.engines))
        out = {"sync/seconds": time.perf_counter() - start}
        if sent is not None:
            out["sync/send_s"] = sent
        received = [r for r in received if r is not None]
        if received:  # the slowest engine's receive (while it kept generating)
            out["sync/receive_s"] = max(received)
        return out


class ColocatedTransport:
    """Colocated: every learner rank gathers the full weights and loads its own engine."""

    def __init__(self, run_on_learners: RunOnLearners):
        self.run_on_learners = run_on_learners

    async def push(self, version: int) -> Dict[str, float]:
        start = time.perf_counter()
        await self.run_on_learners("load_local_engine", version)
        return {"sync/seconds": time.perf_counter() - start}
