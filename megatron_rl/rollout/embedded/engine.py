"""The embedded rollout engine: our Megatron GPTModel, KV-cached, behind the async RolloutEngine API.

A single background task forms batches of waiting requests (requests with equal sampling params,
oldest first, prompts left-padded), runs prefill and decode steps on a dedicated
compute thread (so the event loop stays free for rewards and the trainer), and streams each
step's tokens to the requests. Pause, abort and weight swaps take effect between decode steps;
every token is tagged with the weight version that produced it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ...config.schema import ModelConfig
from ...models.gpt import build_gpt_model, model_device
from ...models.hf_names import hf_to_megatron
from ...types import GenerationChunk, SamplingParams
from ..engine import EngineError, RolloutEngine
from .generator import BatchState, KVCachedGenerator

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt_ids: List[int]
    params: SamplingParams
    queue: "asyncio.Queue" = field(default_factory=asyncio.Queue)
    emitted: int = 0

    @property
    def bucket(self) -> SamplingParams:
        return self.params


@dataclass
class EngineStats:
    requests: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    batches: int = 0


class EmbeddedEngine(RolloutEngine):
    def __init__(self, model_cfg: ModelConfig, vocab_size: int, max_batch_size: int = 256,
                 seed: int = 0, version: int = 0):
        self.model_cfg = model_cfg
        self.model = build_gpt_model(model_cfg, vocab_size)
        self.model.eval()
        self.device = model_device()
        self._gen = KVCachedGenerator(self.model, max_batch_size, model_cfg.max_position_embeddings,
                                      self.device, seed=seed)
        self._version = version
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="embedded-engine")
        self._pending: Deque[_Request] = deque()
        self._running: Dict[str, _Request] = {}
        self._aborted: Set[str] = set()
        self._paused = False
        self._abort_on_pause = False
        self._task: Optional[asyncio.Task] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._resumed: Optional[asyncio.Event] = None
        self._step_lock: Optional[asyncio.Lock] = None
        self._failure: Optional[BaseException] = None
        self.stats = EngineStats()

    # ------------------------------------------------------------------ API
    def weight_version(self) -> int:
        return self._version

    async def generate(self, request_id: str, prompt_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        self._ensure_started()
        if self._failure is not None:
            raise EngineError(f"embedded engine is dead: {self._failure!r}")
        if not prompt_ids:
            raise EngineError(f"request {request_id}: empty prompt")
        req = _Request(request_id, list(prompt_ids), params)
        self._pending.append(req)
        self.stats.requests += 1
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise EngineError(f"request {request_id} failed in the embedded engine: {item!r}") from item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:  # the caller stopped listening: free the slot
                self._aborted.add(request_id)

    async def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        ids = set(request_ids) if request_ids is not None else None
        keep: Deque[_Request] = deque()
        for req in self._pending:
            if ids is None or req.request_id in ids:
                self._finish(req, [], "abort")
            else:
                keep.append(req)
        self._pending = keep
        self._aborted.update(self._running if ids is None else ids & set(self._running))

    async def pause(self, mode: str = "keep") -> None:
        if mode not in ("keep", "abort"):
            raise ValueError(f"pause mode {mode!r}: choose 'keep' or 'abort'")
        self._ensure_started()
        self._paused = True
        self._abort_on_pause = mode == "abort"
        self._resumed.clear()
        if mode == "abort":
            await self.abort()
        async with self._step_lock:  # returns once the step in progress (if any) has finished
            pass

    async def resume(self) -> None:
        self._ensure_started()
        self._paused = False
        self._resumed.set()
        self._wakeup.set()

    async def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        if not self._paused:
            raise EngineError("update_weights needs a paused engine: call pause() first")
        hf = dict(named_tensors)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load, hf)
        self._version = version

    async def shutdown(self) -> None:
        if self._task is not None:
            await self.abort()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ internals
    @torch.no_grad()
    def _load(self, hf: Dict[str, torch.Tensor]) -> None:
        state = self.model.state_dict()
        names = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
        for name, tensor in hf_to_megatron(hf, names, self.model_cfg).items():
            if state[name].shape != tensor.shape:
                raise EngineError(f"weight {name}: engine shape {tuple(state[name].shape)} != "
                                  f"incoming {tuple(tensor.shape)}")
            state[name].copy_(tensor)

    def _ensure_started(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._resumed = asyncio.Event()
            self._resumed.set()
            self._step_lock = asyncio.Lock()
            self._task = asyncio.get_running_loop().create_task(self._serve(), name="embedded-engine")

    def _take_bucket(self) -> List[_Request]:
        key = self._pending[0].bucket
        batch, rest = [], deque()
        for req in self._pending:
            if req.bucket == key and len(batch) < self._gen.max_batch_size:
                batch.append(req)
            else:
                rest.append(req)
        self._pending = rest
        return batch

    async def _compute(self, fn, *args) -> bool:
        """Run one model step on the compute thread; False if paused before it could start."""
        async with self._step_lock:
            if self._paused:
                return False
            start = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
            self.stats.compute_s += time.perf_counter() - start
            return True

    async def _serve(self) -> None:
        try:
            while True:
                while not self._pending or self._paused:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                batch = self._take_bucket()
                try:
                    await self._run_batch(batch)
                except Exception as err:  # noqa: BLE001 - one bad batch must not kill the engine
                    logger.exception("embedded engine batch failed")
                    for req in batch:
                        req.queue.put_nowait(err)
                finally:
                    for req in batch:
                        self._running.pop(req.request_id, None)
                        self._aborted.discard(req.request_id)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001
            self._failure = err
            for req in list(self._pending) + list(self._running.values()):
                req.queue.put_nowait(err)
            raise

    async def _run_batch(self, batch: List[_Request]) -> None:
        self.stats.batches += 1
        for req in batch:
            self._running[req.request_id] = req
        state = BatchState([r.request_id for r in batch], batch[0].params)
        started = False
        while True:
            # Aborts first: a request aborted while the engine is paused must finish now.
            for row, req in enumerate(batch):
                if req.request_id in self._aborted and state.finished[row] is None:
                    state.finished[row] = "abort"
            if state.done:
                break
            if self._paused:
                await self._resumed.wait()
                continue
            if not started:
                started = await self._compute(self._gen.start, state, [r.prompt_ids for r in batch])
            elif not await self._compute(self._gen.step, state):
                continue
            self._emit(batch, state)
        self._emit(batch, state)

    def _emit(self, batch: List[_Request], state: BatchState) -> None:
        for row, req in enumerate(batch):
            if req.emitted < 0:
                continue  # already finished
            new_tokens = state.tokens[row][req.emitted :]
            reason = state.finished[row]
            if not new_tokens and reason is None:
                continue
            self.stats.tokens += len(new_tokens)
            self._finish(req, new_tokens, reason, state.logprobs[row][req.emitted :])

    def _finish(self, req: _Request, tokens: List[int], reason: Optional[str],
                logprobs: Optional[List[float]] = None) -> None:
        req.queue.put_nowait(GenerationChunk(req.request_id, tokens, logprobs or [],
                                             [self._version] * len(tokens), reason))
        req.emitted = -1 if reason is not None else req.emitted + len(tokens)
