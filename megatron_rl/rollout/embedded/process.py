"""The embedded engine in a child process: same engine, its own interpreter.

Inside one process the learner and the engine share the Python interpreter lock, so on a CPU
(where both are Python-heavy) overlapping them buys little. ``EngineProcess`` runs an
``EmbeddedEngine`` in a spawned child and speaks to it over a pipe: requests and aborts go down,
chunks come back as they are produced (messages made in one event-loop turn travel together), and
weights travel packed in one buffer per dtype (``packed.py``; torch shares the storage with the
child, through shared memory on a CPU and a CUDA IPC handle on a GPU, instead of copying it
through the pipe). If the child dies, every request in flight and every call waiting on it fails
with an ``EngineError`` naming the exit code, so the controller returns their prompts to the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp

from ...config.schema import ModelConfig
from ...types import GenerationChunk, SamplingParams
from ..engine import EngineError, RolloutEngine
from .engine import EngineStats
from .packed import PackedWeights, pack_weights

logger = logging.getLogger(__name__)

# Variables of an enclosing torchrun world: the child forms a world of its own. (With
# TORCHELASTIC_USE_AGENT_STORE left set, torch's tcp:// rendezvous connects to a store as a client
# instead of hosting one, and the child waits forever for a server that never comes.)
_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


class _Outbox:
    """Messages posted during one event-loop turn go out as one ``("batch", [...])`` message at
    its end: one pickle and one wake-up of the reader instead of one per message. ``trailer``
    adds a last item to each batch (the child's engine counters)."""

    def __init__(self, send: Callable[[tuple], None], trailer: Optional[Callable[[], tuple]] = None):
        self._send, self._trailer = send, trailer
        self._items: list = []

    def post(self, message: tuple) -> None:
        if not self._items:
            asyncio.get_running_loop().call_soon(self.flush)
        self._items.append(message)

    def flush(self) -> None:
        """Send what was posted now (before a message that must follow it)."""
        if self._items:
            batch, self._items = self._items, []
            if self._trailer is not None:
                batch.append(self._trailer())
            self._send(("batch", batch))


class EngineProcess(RolloutEngine):
    def __init__(self, model_cfg: ModelConfig, vocab_size: int, max_batch_size: int = 256, seed: int = 0,
                 cpu_threads: int = 1, recompute_kv_on_update: bool = False, start_timeout_s: float = 300.0,
                 device_index: Optional[int] = None):
        """``device_index``: the GPU the child computes on (None: CUDA's default device, cuda:0)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._device_index = device_index
        options = dict(model_cfg=dataclasses.asdict(model_cfg), vocab_size=vocab_size,
                       max_batch_size=max_batch_size, seed=seed, cpu_threads=cpu_threads,
                       recompute_kv_on_update=recompute_kv_on_update, device_index=device_index)
        self._proc = ctx.Process(target=_child_main, args=(child, options), name="embedded-engine", daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise EngineError(f"engine process did not start within {start_timeout_s:.0f} s")
        try:
            kind, *rest = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineError(f"engine process exited while starting (exit code {self._proc.exitcode})") from None
        if kind != "ready":
            raise EngineError(f"engine process failed to start: {rest[0]}")
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
        # Requests made in one event-loop turn go down the pipe together (a group's G samples, a
        # whole batch at η = 0).
        self._outbox = _Outbox(self._write_quietly)
        self._shared_weights: Optional[PackedWeights] = None  # CPU buffers the child also holds
        self.stats = EngineStats()

    # ------------------------------------------------------------------ API
    @property
    def failure(self) -> Optional[str]:
        """Why the engine process is gone (None while it serves)."""
        return self._failure

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
        for the whole group: the child joins the responses."""
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
        """The caller stopped listening before the end: free the requests' slots in the child."""
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
        # Packed into buffers whose storage torch hands to the child (shared memory on a CPU, a
        # CUDA IPC handle on a GPU, on the engine's own GPU when it has one). On a CPU both keep
        # the shared buffers: later updates of the same layout are copied into them and only
        # the version goes down the pipe (a segment's handle sent again cost ~1.4 ms a step on
        # a 2-core CPU). Updates never overlap: the next starts after the child replied, i.e.
        # after it copied the last one out. GPU buffers are fresh each time, released after.
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
            torch.cuda.ipc_collect()  # free the buffers of earlier updates the child has released

    async def swap_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """The three calls go down the pipe together and the child runs them in order: one round
        trip on the learner's critical path, not three."""
        paused = asyncio.ensure_future(self.pause())
        loaded = asyncio.ensure_future(self.update_weights(named_tensors, version))
        resumed = asyncio.ensure_future(self.resume())
        await asyncio.gather(paused, loaded, resumed)

    def _weights_device(self) -> Optional[torch.device]:
        """Where to pack: the engine's GPU when it has its own, else where the weights are."""
        if self._device_index is not None and torch.cuda.is_available():
            return torch.device("cuda", self._device_index)
        return None

    async def sampling_state(self) -> Optional[bytes]:
        return await self._call("sampling_state")

    async def set_sampling_state(self, state: Optional[bytes]) -> None:
        await self._call("set_sampling_state", state)

    async def shutdown(self) -> None:
        self._closing = True
        if self._proc.is_alive() and self._failure is None:
            try:
                await asyncio.wait_for(self._call("shutdown"), timeout=30)
            except (EngineError, asyncio.TimeoutError):
                pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()

    # ------------------------------------------------------------------ plumbing
    def _send(self, message: tuple) -> None:
        """Send now, after any posted requests (the child sees messages in the order made)."""
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
            self._fail(self._exit_reason(f"the pipe broke: {err!r}"))
            raise EngineError(self._failure) from None

    async def _call(self, name: str, *args: Any) -> Any:
        self._ensure_reader()
        self._check_alive()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(("call", call_id, name, args))
        return await future

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EngineError(self._failure)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = threading.Thread(target=self._read, name="engine-pipe", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        """Reader thread: hand each message from the child to the event loop."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if self._closing:
                    return
                self._loop.call_soon_threadsafe(self._fail, self._exit_reason("its pipe closed"))
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

    def _exit_reason(self, how: str) -> str:
        self._proc.join(5)
        return f"engine process exited (exit code {self._proc.exitcode}; {how})"

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


# ---------------------------------------------------------------------- the child
def _child_main(conn, options: Dict[str, Any]) -> None:
    for key in _WORLD_ENV:
        os.environ.pop(key, None)
    try:
        from ...learner.parallel import init_model_parallel
        from ...telemetry.run_dir import setup_logging
        from .engine import EmbeddedEngine

        setup_logging()
        torch.set_num_threads(options["cpu_threads"])
        if options["device_index"] is not None:
            # Before anything touches CUDA: the model, its KV cache and the sampler's generator
            # are all built on the current device.
            torch.cuda.set_device(options["device_index"])
        init_model_parallel(1, 1, seed=options["seed"])
        engine = EmbeddedEngine(ModelConfig(**options["model_cfg"]), options["vocab_size"],
                                options["max_batch_size"], seed=options["seed"],
                                recompute_kv_on_update=options["recompute_kv_on_update"])
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("failed", repr(err)))
        return
    conn.send(("ready",))
    asyncio.run(_ChildServer(conn, engine).run())


class _ChildServer:
    def __init__(self, conn, engine) -> None:
        self.conn, self.engine = conn, engine
        self.tasks: Dict[str, asyncio.Task] = {}
        self.shared_weights = None  # the parent's shared-memory weight buffers (CPU), reused
        # Chunks finished in one event-loop turn (often a whole decode step's worth of requests)
        # go up together, followed by the engine's counters once.
        self.outbox = _Outbox(self.send, trailer=lambda: ("stats", self.engine.stats))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def read() -> None:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):  # the parent is gone: stop
                    message = ("call", -1, "shutdown", ())
                messages = message[1] if message[0] == "batch" else [message]
                loop.call_soon_threadsafe(lambda batch=messages: [inbox.put_nowait(m) for m in batch])
                if any(m[0] == "call" and m[2] == "shutdown" for m in messages):
                    return

        threading.Thread(target=read, name="engine-inbox", daemon=True).start()
        while True:
            message = await inbox.get()
            # Requests reach the engine's queue as their message is read (a task would join it
            # later): an abort in the next message must find them.
            if message[0] == "generate":
                _, request_id, prompt_ids, params = message
                try:
                    stream = self.engine.generate(request_id, prompt_ids, params)
                except Exception as err:  # noqa: BLE001 - the parent raises it for this request
                    self.outbox.post(("error", request_id, str(err)))
                    continue
                self.tasks[request_id] = asyncio.create_task(self.stream(request_id, stream))
            elif message[0] == "generate_n":
                _, key, request_ids, prompt_ids, params = message
                try:
                    responses = self.engine.generate_n(request_ids, prompt_ids, params)
                except Exception as err:  # noqa: BLE001 - the parent raises it for this group
                    self.outbox.post(("group_error", key, str(err)))
                    continue
                self.tasks[f"group-{key}"] = asyncio.create_task(self.group(key, responses))
            elif message[0] == "abort":
                await self.engine.abort(message[1])
            elif message[0] == "call":
                _, call_id, name, args = message
                error = result = None
                try:
                    if name == "update_weights_shared":  # new contents of the buffers kept below
                        name, args = "update_weights", (self.shared_weights, *args)
                    elif name == "update_weights" and args[0].on_cpu:
                        self.shared_weights = args[0]
                    result = await getattr(self.engine, name)(*args)
                except Exception as err:  # noqa: BLE001 - the parent raises it
                    error = f"{name} failed in the engine process: {err}"
                if name == "shutdown":
                    await asyncio.gather(*self.tasks.values(), return_exceptions=True)
                self.reply(("reply", call_id, error, self.engine.stats, result))
                if name == "shutdown":
                    return

    async def stream(self, request_id: str, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                self.outbox.post(("chunk", request_id, chunk))
        except Exception as err:  # noqa: BLE001 - the parent raises it for this request
            self.outbox.post(("error", request_id, str(err)))
        finally:
            self.tasks.pop(request_id, None)

    async def group(self, key: int, responses: Awaitable[List[GenerationChunk]]) -> None:
        try:
            self.outbox.post(("group", key, await responses))
        except Exception as err:  # noqa: BLE001 - the parent raises it for this group
            self.outbox.post(("group_error", key, str(err)))
        finally:
            self.tasks.pop(f"group-{key}", None)

    def reply(self, message: tuple) -> None:
        """A call's reply goes now, after the chunks posted before it."""
        self.outbox.flush()
        self.send(message)

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            pass  # the parent is gone; the inbox reader stops the loop
