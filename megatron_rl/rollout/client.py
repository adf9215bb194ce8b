"""The client side of ``serve.py``'s protocol: a RolloutEngine whose engine lives elsewhere.

``EngineClient`` speaks to an ``EngineServer`` over a connection (a pipe to a child process, a
TCP connection to another rank). A reader thread hands each message to the event loop; requests
made in one event-loop turn go out together. If the connection breaks, every request in flight
and every call waiting on it fails with an ``EngineError`` naming the engine and why, so the
controller returns their prompts to the queue; a control call that gets no answer within
``call_timeout_s`` fails the same way (a stuck engine is reported, never waited on forever).
Subclasses say how the engine was reached and what is known when it goes (``_exit_reason``,
``_close``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any, AsyncIterator, Awaitable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..types import GenerationChunk, SamplingParams
from ..api.engine import EngineError, RolloutEngine
from .embedded.engine import EngineStats
from .embedded.packed import PackedWeights, pack_weights
from .serve import Outbox

logger = logging.getLogger(__name__)


class EngineClient(RolloutEngine):
    def __init__(self, conn, name: str, call_timeout_s: Optional[float] = None):
        self._conn = conn
        self.name = name
        self.call_timeout_s = call_timeout_s
        self._version = 0
        self._send_lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._reader: Optional[threading.Thread] = None
        self._streams: Dict[str, asyncio.Queue] = {}
        self._calls: Dict[int, asyncio.Future] = {}
        self._groups: Dict[int, asyncio.Future] = {}  # generate_n requests, by call id
        self._call_ids = itertools.count()
        self._failure: Optional[str] = None
        self._closing = False
        # Requests made in one event-loop turn go down together (a group's G samples, a whole
        # batch at η = 0).
        self._outbox = Outbox(self._write_quietly)
        self._shared_weights: Optional[PackedWeights] = None  # CPU buffers the server also holds
        self.stats = EngineStats()

    # ------------------------------------------------------------------ API
    @property
    def failure(self) -> Optional[str]:
        """Why the engine is gone (None while it serves)."""
        return self._failure

    @property
    def in_flight(self) -> int:
        """Requests and groups sent and not yet answered (the pool's measure of load)."""
        return len(self._streams) + len(self._groups)

    def weight_version(self) -> int:
        return self._version

    async def generate(self, request_id: str, prompt_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        self._ensure_reader()
        self._check_alive()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            self._outbox.post(("generate", request_id, list(prompt_ids), params))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_unheard([request_id])

    def generate_n(self, request_ids: Sequence[str], prompt_ids: Sequence[int],
                   params: SamplingParams) -> Awaitable[List[GenerationChunk]]:
        """One message down (posted now, so an abort made afterwards follows it) and one back
        for the whole group: the server joins the responses."""
        self._ensure_reader()
        self._check_alive()
        key = next(self._call_ids)
        future = self._loop.create_future()
        self._groups[key] = future
        self._outbox.post(("generate_n", key, list(request_ids), list(prompt_ids), params))
        return self._group_result(key, future, list(request_ids))

    async def _group_result(self, key: int, future: asyncio.Future, request_ids: List[str]) -> List[GenerationChunk]:
        finished = False
        try:
            responses = await future
            finished = True
            return responses
        finally:
            self._groups.pop(key, None)
            if not finished:
                self._abort_unheard(request_ids)

    def _abort_unheard(self, request_ids: List[str]) -> None:
        """The caller stopped listening before the end: free the requests' slots in the engine."""
        if self._failure is None:
            try:
                self._send(("abort", request_ids))
            except EngineError:
                pass  # already recorded as the engine's failure

    async def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        await self._call("abort", list(request_ids) if request_ids is not None else None)

    async def pause(self, mode: str = "keep") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        # Packed into buffers whose storage torch hands to the server's process (shared memory on
        # a CPU, a CUDA IPC handle on a GPU, on the engine's own GPU when it has one); only for
        # an engine on this machine. On a CPU both keep the shared buffers: later updates of the
        # same layout are copied into them and only the version goes down the connection (a
        # segment's handle sent again cost ~1.4 ms a step on a 2-core CPU). Updates never
        # overlap: the next starts after the server replied, i.e. after it copied the last one
        # out. GPU buffers are fresh each time, released after.
        shared = self._shared_weights
        packed = pack_weights(named_tensors, self._weights_device(), into=shared)
        if shared is not None and packed.buffers is shared.buffers:
            await self._call("update_weights_shared", version)
        else:
            await self._call("update_weights", packed, version)
            self._shared_weights = packed if packed.on_cpu else None
        self._version = version
        del packed
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free the buffers of earlier updates the server has released

    async def swap_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """The three calls go down together and the server runs them in order: one round trip on
        the learner's critical path, not three."""
        paused = asyncio.ensure_future(self.pause())
        loaded = asyncio.ensure_future(self.update_weights(named_tensors, version))
        resumed = asyncio.ensure_future(self.resume())
        await asyncio.gather(paused, loaded, resumed)

    def _weights_device(self) -> Optional[torch.device]:
        """Where to pack weights for the server (None: where they are)."""
        return None

    async def sampling_state(self) -> Optional[bytes]:
        return await self._call("sampling_state")

    async def set_sampling_state(self, state: Optional[bytes]) -> None:
        await self._call("set_sampling_state", state)

    async def sleep(self) -> None:
        await self._call("sleep")

    async def wake_up(self) -> None:
        await self._call("wake_up")

    async def shutdown(self) -> None:
        self._closing = True
        if self._failure is None and self._alive():
            try:
                await asyncio.wait_for(self._call("shutdown"), timeout=30)
            except (EngineError, asyncio.TimeoutError):
                pass
        self._close()
        self._conn.close()

    # ------------------------------------------------------------------ for subclasses
    def _alive(self) -> bool:
        return True

    def _close(self) -> None:
        """Release what reaching the engine took (a child process, ...), after ``shutdown``."""

    def _exit_reason(self, how: str) -> str:
        return f"{self.name} is gone ({how})"

    def _failed_reason(self, reason: str) -> str:
        """The server said its engine is gone (its process lives on)."""
        return f"{self.name} is gone ({reason})"

    # ------------------------------------------------------------------ plumbing
    def _send(self, message: tuple) -> None:
        """Send now, after any posted requests (the server sees messages in the order made)."""
        self._outbox.flush()
        self._write(message)

    def _write_quietly(self, message: tuple) -> None:
        try:
            self._write(message)
        except EngineError:
            pass  # recorded as the engine's failure: every stream waiting on it fails

    def _write(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (BrokenPipeError, OSError) as err:
            self._fail(self._exit_reason(f"the connection broke: {err!r}"))
            raise EngineError(self._failure) from None

    async def _call(self, name: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        self._ensure_reader()
        self._check_alive()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(("call", call_id, name, args))
        limit = timeout_s if timeout_s is not None else self.call_timeout_s
        if limit is None:
            return await future
        try:
            return await asyncio.wait_for(future, limit)
        except asyncio.TimeoutError:
            self._fail(f"{self.name} did not answer {name} within {limit:.0f} s (stuck?)")
            raise EngineError(self._failure) from None

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EngineError(self._failure)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        """Reader thread: hand each message from the server to the event loop."""
        while True:
            try:
                message = self._conn.recv()
            # TypeError: shutdown() closed this end while recv() waited on it (multiprocessing's
            # connection then reads from a handle of None).
            except (EOFError, OSError, TypeError):
                if self._closing:
                    return
                self._loop.call_soon_threadsafe(self._fail, self._exit_reason("its connection closed"))
                return
            self._loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "batch":
            for item in message[1]:
                self._dispatch(item)
        elif kind == "chunk":
            _, request_id, chunk = message
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(chunk)
        elif kind == "error":
            _, request_id, text = message
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(EngineError(text))
        elif kind in ("group", "group_error"):
            _, key, payload = message
            future = self._groups.get(key)
            if future is not None and not future.done():
                if kind == "group":
                    future.set_result(payload)
                else:
                    future.set_exception(EngineError(payload))
        elif kind == "reply":
            _, call_id, error, stats, result = message
            self.stats = stats
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(EngineError(error))
        elif kind == "stats":
            self.stats = message[1]
        elif kind == "engine_failed":
            self._fail(self._failed_reason(message[1]))

    def _fail(self, reason: str) -> None:
        if self._failure is not None:
            return
        self._failure = reason
        logger.error("%s; %d requests and %d groups in flight fail", reason, len(self._streams), len(self._groups))
        for queue in self._streams.values():
            queue.put_nowait(EngineError(reason))
        for future in list(self._calls.values()) + list(self._groups.values()):
            if not future.done():
                future.set_exception(EngineError(reason))
        self._calls.clear()
