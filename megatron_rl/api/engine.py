"""The RolloutEngine interface (DESIGN.md): token ids in, token ids + logprobs + versions out."""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..types import GenerationChunk, SamplingParams


class EngineError(RuntimeError):
    """An engine could not serve a request (it died, was misused, or was given bad input)."""


@dataclass
class EngineStats:
    """What an engine counts, read by the driver after each step (engine/* metrics)."""
    requests: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    prefills: int = 0       # batches (re)built from slot 0: first batch, offset exhausted, new weights
    admissions: int = 0     # waiting requests prefilled into the running batch
    decode_steps: int = 0
    decode_rows: int = 0    # running rows summed over decode steps (occupancy = rows / steps)
    # Compute seconds by kind of model call (compute_s is their sum).
    prefill_s: float = 0.0
    admit_s: float = 0.0
    decode_s: float = 0.0
    # Decode buckets captured (CUDA graphs; on a CPU with the static step, buckets registered),
    # those captured during a run rather than at start (each a stall on a GPU), and their seconds.
    captures: int = 0
    late_captures: int = 0
    capture_s: float = 0.0


class RolloutEngine(abc.ABC):
    """An asynchronous generation engine holding one version of the policy weights.

    Besides the calls below, the driver reads ``stats`` (counters), ``failure`` (why the engine
    is gone) and ``engines`` (the engines behind this one): each has a default here, so that an
    engine which does not count, cannot die apart from its caller or fronts no others need not
    say so."""

    @property
    def stats(self) -> EngineStats:
        """Counters since the engine started (an engine that counts nothing reads zeros)."""
        return self.__dict__.setdefault("_engine_stats", EngineStats())

    @stats.setter
    def stats(self, value: EngineStats) -> None:
        self.__dict__["_engine_stats"] = value

    @property
    def failure(self) -> Optional[str]:
        """Why the engine is gone, once it is (None while it serves, or where it cannot tell)."""
        return None

    @property
    def engines(self) -> List["RolloutEngine"]:
        """The engines this one fronts (a pool's members); an engine alone is its own."""
        return [self]

    def pids(self) -> List[int]:
        """The processes of its own that it computes in (none: it computes in its caller's), for
        the world's list of which process is which."""
        return []



    @abc.abstractmethod
    def generate(self, request_id: str, prompt_ids: Sequence[int],
                 params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream chunks of generated tokens; the last chunk has ``finish_reason`` set."""

    def generate_n(self, request_ids: Sequence[str], prompt_ids: Sequence[int],
                   params: SamplingParams) -> Awaitable[List[GenerationChunk]]:
        """One response per request id to the same prompt (a GRPO group), each whole: one chunk
        with every token. Engines in another process answer with one message per group, not
        one per response, which on a busy trainer's event loop is most of the rollout overhead.
        The requests are made when this is called (where the engine's ``generate`` is eager), so
        an abort made afterwards finds them. The token fields of each response are numpy arrays
        (``trajectory_buffers.response_arrays``), whichever engine answers."""
        gathered = asyncio.gather(*(whole_response(self.generate(rid, prompt_ids, params)) for rid in request_ids))
        return asyncio.ensure_future(_as_arrays(gathered))

    @abc.abstractmethod
    async def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        """Finish the given requests (all when None) with ``finish_reason="abort"``."""

    @abc.abstractmethod
    async def pause(self, mode: str = "keep") -> None:
        """Stop generating at the next step. ``keep`` holds in-flight requests to continue after
        ``resume`` (their later tokens carry the new version); ``abort`` finishes them."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue generating after ``pause``."""

    @abc.abstractmethod
    async def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]],
                             version: int) -> Optional[Dict[str, float]]:
        """Load Hugging Face-named full tensors as policy ``version``; only while paused. Returns
        the engine's own figures of the transfer where it keeps them (``sync/...`` metrics)."""

    async def swap_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]],
                           version: int) -> Optional[Dict[str, float]]:
        """Pause at the next step, load ``version``, resume: in-flight requests continue on it.
        Returns what ``update_weights`` returned."""
        await self.pause()
        figures = await self.update_weights(named_tensors, version)
        await self.resume()
        return figures

    @abc.abstractmethod
    def weight_version(self) -> int:
        """The policy version of the weights currently loaded."""

    async def sampling_state(self) -> Optional[bytes]:
        """The sampler's random state, for exact resume (None where the engine cannot expose it)."""
        return None

    async def set_sampling_state(self, state: Optional[bytes]) -> None:
        """Restore what ``sampling_state`` returned (ignored where unsupported)."""

    async def sleep(self) -> None:
        """Free accelerator memory for colocated training (no-op where unsupported)."""

    async def wake_up(self) -> None:
        """Undo ``sleep``."""

    async def shutdown(self) -> None:
        """Stop background work and release resources."""


async def whole_response(stream: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    """A request's chunks joined into one (``finish_reason`` "abort" if the stream stopped early),
    their ``routed_experts`` too (concatenated in position order) where the engine records them."""
    request_id, tokens, logprobs, versions, finish, routing = "", [], [], [], "abort", []
    async for chunk in stream:
        request_id = chunk.request_id
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        if chunk.routed_experts is not None:
            routing.append(chunk.routed_experts)
        if chunk.finish_reason is not None:
            finish = chunk.finish_reason
    return GenerationChunk(request_id, tokens, logprobs, versions, finish, routed_experts=_joined(routing))


async def _as_arrays(responses: Awaitable[List[GenerationChunk]]) -> List[GenerationChunk]:
    from ..trajectory_buffers import response_arrays

    return [response_arrays(r) for r in await responses]


def _joined(parts: list):
    """Routing arrays of consecutive chunks as one (None when there are none)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    import numpy as np

    return np.concatenate(parts)


async def failure_within(engine: RolloutEngine, seconds: float, poll_s: float = 0.05) -> Optional[str]:
    """The engine's ``failure`` (why it is gone), waiting up to ``seconds`` for one to be reported.

    For a failure whose cause is not yet known: a weight broadcast's sending side can fail (its
    peer is gone) before the engine's rank has noticed, and reported, that its engine died."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        failure = engine.failure
        if failure or asyncio.get_running_loop().time() >= deadline:
            return failure or None
        await asyncio.sleep(poll_s)


def raise_if_gone(engines: Sequence[RolloutEngine], failure: Optional[str] = None) -> None:
    """Stop the run with one line when an engine is gone: ``failure`` (a death already known) or
    the first engine's own report. The one place a dead engine is named, for rollouts and weight
    pushes alike."""
    from ..scheduler.controller import RolloutsStopped

    failure = failure or next((f for f in (getattr(e, "failure", None) for e in engines) if f), None)
    if failure:
        raise RolloutsStopped(f"the rollout engine is gone ({failure}); the prompts it held were "
                              "returned to the queue and the run stopped. Its last words are in "
                              "logs/train.log") from None


async def raise_if_gone_within(engines: Sequence[RolloutEngine], seconds: float) -> None:
    """``raise_if_gone`` once any engine reports its death within ``seconds`` (nothing if none
    does): a transfer's sending side can fail before the engine's rank has noticed its death."""
    failures = await asyncio.gather(*(failure_within(e, seconds) for e in engines))
    raise_if_gone(engines, next((f for f in failures if f), None))
