"""Serving a RolloutEngine over a connection: the engine's side of the wire protocol.

One protocol reaches an engine wherever it runs: in a child process of the trainer (a pipe,
``embedded/process.py``), on another rank of a torchrun world (a TCP connection,
``remote.py``), or behind a colocated learner rank. The client (``client.py``) sends requests,
aborts and calls; the server answers with chunks, whole groups and replies. Messages made in one
event-loop turn travel together (``Outbox``), so a GRPO group's requests or a decode step's
finished responses cost one message, not one each.

Messages down: ``("generate", request_id, prompt_ids, params)``, ``("generate_n", key,
request_ids, prompt_ids, params)``, ``("abort", ids | None)``, ``("call", call_id, name, args)``.
Messages up: ``("chunk", request_id, chunk)``, ``("error", request_id, text)``, ``("group", key,
responses)``, ``("group_error", key, text)``, ``("reply", call_id, error, stats, result)``,
``("stats", stats)``, ``("engine_failed", reason)`` (the engine behind the server is gone, e.g. vLLM's
engine core died while this process lives on). Any of them may arrive inside a ``("batch", [...])``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional

from ..trajectory_buffers import response_arrays
from ..types import GenerationChunk
from ..api.engine import RolloutEngine

logger = logging.getLogger(__name__)

# A call the server answers itself instead of the engine: name -> coroutine function of the args.
ExtraCall = Callable[..., Awaitable[Any]]


class Outbox:
    """Messages posted during one event-loop turn go out as one ``("batch", [...])`` message at
    its end: one pickle and one wake-up of the reader instead of one per message. ``trailer``
    adds a last item to each batch (the server's engine counters)."""

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


class EngineServer:
    """Answers one client's messages with ``engine``, until the client says ``shutdown`` or its
    connection closes (the client is gone: the engine is shut down and ``run`` returns).

    ``extra`` names calls the server runs itself (e.g. ``receive_weights`` on an engine rank,
    which takes the weights from the weight-sync group, not from the connection)."""

    def __init__(self, conn, engine: RolloutEngine, extra: Optional[Dict[str, ExtraCall]] = None) -> None:
        self.conn, self.engine = conn, engine
        self.extra = dict(extra or {})
        self.tasks: Dict[str, asyncio.Task] = {}
        self.shared_weights = None  # the client's shared-memory weight buffers (CPU), reused
        # Chunks finished in one event-loop turn (often a whole decode step's worth of requests)
        # go up together, followed by the engine's counters once.
        self.outbox = Outbox(self.send, trailer=lambda: ("stats", self.engine.stats))
        self._failure_reported = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def read() -> None:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):  # the client is gone: stop
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
                except Exception as err:  # noqa: BLE001 - the client raises it for this request
                    self.post_error(("error", request_id, str(err)))
                    continue
                self.tasks[request_id] = asyncio.create_task(self.stream(request_id, stream))
            elif message[0] == "generate_n":
                _, key, request_ids, prompt_ids, params = message
                try:
                    responses = self.engine.generate_n(request_ids, prompt_ids, params)
                except Exception as err:  # noqa: BLE001 - the client raises it for this group
                    self.post_error(("group_error", key, str(err)))
                    continue
                self.tasks[f"group-{key}"] = asyncio.create_task(self.group(key, responses))
            elif message[0] == "abort":
                await self.engine.abort(message[1])
            elif message[0] == "call":
                _, call_id, name, args = message
                if name in self.extra:
                    # Runs beside the engine (e.g. a weight receive while it keeps generating).
                    self.tasks[f"call-{call_id}"] = asyncio.create_task(self.extra_call(call_id, name, args))
                    continue
                await self.call(call_id, name, args)
                if name == "shutdown":
                    return

    async def call(self, call_id: int, name: str, args: tuple) -> None:
        error = result = None
        try:
            if name == "update_weights_shared":  # new contents of the buffers kept below
                name, args = "update_weights", (self.shared_weights, *args)
            elif name == "update_weights" and args[0].on_cpu:
                self.shared_weights = args[0]
            result = await getattr(self.engine, name)(*args)
        except Exception as err:  # noqa: BLE001 - the client raises it
            error = f"{name} failed in the engine: {err}"
            self.report_failure()
        if name == "shutdown":
            # Requests finish (aborted or done) first. An extra call still running is not waited
            # for: a weight receive whose sender died would block until the group's timeout.
            await asyncio.gather(*(t for key, t in self.tasks.items() if not key.startswith("call-")),
                                 return_exceptions=True)
        self.reply(("reply", call_id, error, self.engine.stats, result))

    async def extra_call(self, call_id: int, name: str, args: tuple) -> None:
        error = result = None
        try:
            result = await self.extra[name](*args)
        except Exception as err:  # noqa: BLE001 - the client raises it
            logger.exception("%s failed", name)
            error = f"{name} failed in the engine: {err!r}"
            # Posted before the reply (which flushes it first): a caller that sees the error
            # can already tell a dead engine from a failed call.
            self.report_failure()
        finally:
            self.tasks.pop(f"call-{call_id}", None)
        self.reply(("reply", call_id, error, self.engine.stats, result))

    async def stream(self, request_id: str, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                self.outbox.post(("chunk", request_id, chunk))
        except Exception as err:  # noqa: BLE001 - the client raises it for this request
            self.post_error(("error", request_id, str(err)))
        finally:
            self.tasks.pop(request_id, None)

    async def group(self, key: int, responses: Awaitable[List[GenerationChunk]]) -> None:
        try:
            # Token fields as arrays: the driver receives the group without an object per token.
            self.outbox.post(("group", key, [response_arrays(r) for r in await responses]))
        except Exception as err:  # noqa: BLE001 - the client raises it for this group
            self.post_error(("group_error", key, str(err)))
        finally:
            self.tasks.pop(f"group-{key}", None)

    def post_error(self, message: tuple) -> None:
        """A request's or group's error, followed in the same batch by the engine's death if that
        is why: the client records the death before the error's waiter runs."""
        self.outbox.post(message)
        self.report_failure()

    def report_failure(self) -> None:
        """Once the engine says it is gone (``failure``), tell the client: a failed request alone
        does not say whether the engine can still serve others."""
        reason = self.engine.failure
        if reason and not self._failure_reported:
            self._failure_reported = True
            self.outbox.post(("engine_failed", reason))

    def reply(self, message: tuple) -> None:
        """A call's reply goes now, after the chunks posted before it."""
        self.outbox.flush()
        self.send(message)

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            pass  # the client is gone; the inbox reader stops the loop
