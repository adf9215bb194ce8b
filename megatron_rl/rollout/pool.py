"""Several engines behind one RolloutEngine: requests spread by load, control calls to all.

A request (or a GRPO group, kept whole on one engine so its shared prompt is prefilled once)
goes to the engine with the fewest requests outstanding. Pause, resume, abort-all, sleep and
shutdown go to every engine; counters are summed. The pool reports the first engine's failure
as its own: the trainer then stops the run, and every group that engine held fails, so its
prompt goes back to the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from typing import AsyncIterator, Awaitable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..types import GenerationChunk, SamplingParams
from ..api.engine import EngineError, RolloutEngine


class EnginePool(RolloutEngine):
    def __init__(self, engines: Sequence[RolloutEngine]):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self._members = list(engines)
        self._load = [0] * len(self.engines)        # requests outstanding, per engine
        self._owner: Dict[str, int] = {}            # request id -> engine index

    # ------------------------------------------------------------------ requests
    def _pick(self) -> int:
        return min(range(len(self.engines)), key=lambda i: (self._load[i], i))

    def generate(self, request_id: str, prompt_ids: Sequence[int],
                 params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        i = self._pick()
        return self._tracked_stream(i, request_id, self.engines[i].generate(request_id, prompt_ids, params))

    async def _tracked_stream(self, i: int, request_id: str,
                              stream: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
        self._load[i] += 1
        self._owner[request_id] = i
        try:
            async for chunk in stream:
                yield chunk
        finally:
            self._load[i] -= 1
            self._owner.pop(request_id, None)

    def generate_n(self, request_ids: Sequence[str], prompt_ids: Sequence[int],
                   params: SamplingParams) -> Awaitable[List[GenerationChunk]]:
        i = self._pick()
        answer = self.engines[i].generate_n(request_ids, prompt_ids, params)  # sent now (eager)
        self._load[i] += len(request_ids)
        for rid in request_ids:
            self._owner[rid] = i
        return self._tracked_group(i, list(request_ids), answer)

    async def _tracked_group(self, i: int, request_ids: List[str],
                             answer: Awaitable[List[GenerationChunk]]) -> List[GenerationChunk]:
        try:
            return await answer
        finally:
            self._load[i] -= len(request_ids)
            for rid in request_ids:
                self._owner.pop(rid, None)

    def _live(self) -> List[RolloutEngine]:
        return [e for e in self.engines if not e.failure]

    async def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        """Abort on the engines still serving (a dead engine's requests have failed already)."""
        if request_ids is None:
            await asyncio.gather(*(e.abort() for e in self._live()))
            return
        by_engine: Dict[int, List[str]] = {}
        for rid in request_ids:
            if rid in self._owner:
                by_engine.setdefault(self._owner[rid], []).append(rid)
        live = self._live()
        await asyncio.gather(*(self.engines[i].abort(ids) for i, ids in by_engine.items() if self.engines[i] in live))

    # ------------------------------------------------------------------ control
    async def _all(self, call) -> list:
        return await asyncio.gather(*(call(e) for e in self.engines))

    async def pause(self, mode: str = "keep") -> None:
        await self._all(lambda e: e.pause(mode))

    async def resume(self) -> None:
        await self._all(lambda e: e.resume())

    async def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]],
                             version: int) -> Optional[Dict[str, float]]:
        tensors = list(named_tensors)  # every engine reads them
        return _slowest(await self._all(lambda e: e.update_weights(tensors, version)))

    async def swap_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]],
                           version: int) -> Optional[Dict[str, float]]:
        tensors = list(named_tensors)
        return _slowest(await self._all(lambda e: e.swap_weights(tensors, version)))

    def weight_version(self) -> int:
        return min(e.weight_version() for e in self.engines)

    async def sampling_state(self) -> Optional[bytes]:
        states = await self._all(lambda e: e.sampling_state())
        return pickle.dumps(states)

    async def set_sampling_state(self, state: Optional[bytes]) -> None:
        if state is None:
            return
        states = pickle.loads(state)
        if not isinstance(states, list) or len(states) != len(self.engines):
            raise EngineError(f"the checkpoint holds the sampling state of {len(states) if isinstance(states, list) else 1} "
                              f"engine(s), this run has {len(self.engines)}: resume with the same rollout.engines")
        await asyncio.gather(*(e.set_sampling_state(s) for e, s in zip(self.engines, states)))

    async def sleep(self) -> None:
        await self._all(lambda e: e.sleep())

    async def wake_up(self) -> None:
        await self._all(lambda e: e.wake_up())

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)

    # ------------------------------------------------------------------ state
    @property
    def engines(self) -> List[RolloutEngine]:
        return self._members

    @property
    def failure(self) -> Optional[str]:
        for engine in self.engines:
            failure = engine.failure
            if failure:
                return failure
        return None

    @property
    def stats(self):
        """The engines' counters summed field by field."""
        first = self.engines[0].stats
        total = dataclasses.replace(first)
        for engine in self.engines[1:]:
            for f in dataclasses.fields(total):
                setattr(total, f.name, getattr(total, f.name) + getattr(engine.stats, f.name))
        return total


def _slowest(figures: List[Optional[Dict[str, float]]]) -> Optional[Dict[str, float]]:
    """The engines' transfer figures as one: each the largest over the engines (the slowest
    engine's seconds; bytes are the same for all)."""
    known = [f for f in figures if f]
    if not known:
        return None
    return {key: max(f[key] for f in known if key in f) for key in {k for f in known for k in f}}
