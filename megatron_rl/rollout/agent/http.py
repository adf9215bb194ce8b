"""The chat server's HTTP/1.1 layer, on aiohttp's low-level server (imported when the first agent
run starts the server, so config validation stays light).

aiohttp parses the requests; what it refuses before a request reaches the server (a request line
with no method or path, a negative or non-numeric Content-Length, an oversized header line, too
many headers) is answered here with the same OpenAI-shaped JSON error body as every other error,
``{"error": {"message", "type", "param", "code"}}``, and logged as one WARNING line: no
traceback, the trainer's log stays readable whatever an agent sends."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable, Dict, Optional, Tuple

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger("megatron_rl.rollout.agent.server")

# The longest request body read (a whole conversation with its tools); aiohttp's default is 1 MiB.
MAX_BODY_BYTES = 64 * 1024 * 1024

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error shape (what ``openai`` clients read into their exceptions)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_response(status: int, body: Dict[str, Any]) -> web.Response:
    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json")


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Protocol(RequestHandler):
    """aiohttp's connection handler, answering the requests its parser refuses in OpenAI's shape,
    and keeping a connection open for the answer when the client ends its side in the middle of a
    request body (a truncated body gets its 400 instead of a silent close)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.peer_eof = asyncio.Event()

    def eof_received(self) -> Optional[bool]:
        self.peer_eof.set()
        waiter = self._waiter  # aiohttp's idle wait for the next request (aiohttp pinned in requirements.txt)
        if waiter is not None and not waiter.done():
            return None  # idle: the connection closes, as aiohttp does
        self.close()  # a request is under way: it is answered (400 if its body is cut short), then closed
        return True

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError) and exc.message:
            text = exc.message if isinstance(exc.message, str) else repr(exc.message)
        elif exc is not None:
            text = f"{type(exc).__name__}: {exc}"
        else:
            text = message or "the request could not be read"
        text = _one_line(text)
        kind = "server_error" if status >= 500 else "invalid_request_error"
        logger.warning("chat server: answered %d to a request it could not read (%s)", status, text[:300])
        if request.writer.output_size > 0:  # a response was under way: the connection is broken
            raise ConnectionError("a response was already sent; cannot send the error")
        if status < 500:
            text = f"malformed HTTP request: {text}"
        response = json_response(status, error_body(text, kind, code="malformed_request" if status < 500 else None))
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's low-level server with ``_Protocol`` as its connection handler."""

    def __init__(self, handler: Handler, loop: asyncio.AbstractEventLoop, **protocol_kwargs: Any):
        super().__init__(handler, request_factory=self._request, loop=loop, **protocol_kwargs)
        self.loop, self.protocol_kwargs = loop, protocol_kwargs

    def _request(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, self.loop, client_max_size=MAX_BODY_BYTES)

    def __call__(self) -> RequestHandler:
        return _Protocol(self, loop=self.loop, **self.protocol_kwargs)


async def read_body(request: web.BaseRequest, timeout_s: float) -> bytes:
    """The whole body of ``request``; ValueError with what arrived when the client ended its side
    before Content-Length bytes came, or sent nothing more for ``timeout_s`` seconds."""
    protocol = request.protocol
    if not isinstance(protocol, _Protocol) or not request.content_length:
        return await request.read()
    read = asyncio.ensure_future(request.read())
    eof = asyncio.ensure_future(protocol.peer_eof.wait())
    try:
        waiting = {read, eof}
        while read not in (done := (await asyncio.wait(waiting, timeout=timeout_s,
                                                       return_when=asyncio.FIRST_COMPLETED))[0]):
            if not done or request.content.total_bytes < request.content_length:
                ended = "then ended its side of the connection" if done else f"then nothing for {timeout_s:g} s"
                raise ValueError(f"the body is truncated: {request.content.total_bytes} of "
                                 f"{request.content_length} bytes (Content-Length) arrived, {ended}")
            waiting = {read}  # every byte arrived before the end: finish reading
        return read.result()
    finally:
        for task in (read, eof):
            if not task.done():
                task.cancel()


async def serve(handler: Handler, host: str) -> Tuple[web.BaseRunner, int]:
    """Listen on ``host`` and a free port; (runner to ``cleanup()``, port)."""
    # lingering_time=0: after answering a request whose body was cut short, close at once instead
    # of waiting for the rest (the body is read whole before any other answer).
    server = _Server(handler, asyncio.get_running_loop(), access_log=None, lingering_time=0)
    # A stop does not wait for calls still generating: their runs are over.
    runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, runner.addresses[0][1]
