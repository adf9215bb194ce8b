"""A small OpenAI-compatible chat-completions server over a RolloutEngine.

Agents talk to it with the standard ``openai`` client. Each agent run gets its own base URL,
``http://127.0.0.1:<port>/runs/<run id>/v1``, so every call is attributed to its run without
anything in the request body. A call renders the messages (and ``tools``) with the tokenizer's
chat template, encodes them, generates on the engine under the run's sampling parameters, and
records the exact prompt ids, completion ids, logprobs and per-token policy versions as a
``Turn``. The prompt ids of a call whose text extends an earlier call's prompt + completion reuse
that call's ids and encode only the new text, so a growing conversation stays one token
sequence (re-encoding the model's own answer could split it into different tokens).

Only what agents need is served: ``POST .../chat/completions`` (not streamed) and
``GET .../models``. The run's sampling parameters (``rollout.temperature`` etc.) govern every
call, so the behaviour logprobs are the ones the learner corrects for; a request's ``max_tokens``
(or ``max_completion_tokens``) can only lower the run's ``rollout.max_new_tokens``. Plain
asyncio HTTP/1.1 with keep-alive: no web framework to install, and it runs on the trainer's loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from ...types import SamplingParams
from ..engine import EngineError, RolloutEngine, whole_response
from .tool_calls import messages_for_template, parse_tool_calls
from .trajectories import Turn

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            409: "Conflict", 500: "Internal Server Error", 503: "Service Unavailable"}


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class AgentRun:
    """What the server knows of one run: its request-id tag, sampling, and the turns so far."""

    run_id: str
    params: SamplingParams
    turns: List[Turn] = field(default_factory=list)
    # (text, ids) of each call's prompt + completion, for extending prompts token-exactly.
    history: List[Tuple[str, List[int]]] = field(default_factory=list)
    # An engine call ended in "abort" (a stop or an interrupt): the run is void and retried.
    aborted: bool = False


class ChatServer:
    """``await start()``, then ``open_run(run_id, params)`` per agent run, ``base_url(run_id)`` for
    its client and ``close_run(run_id)`` for its turns."""

    def __init__(self, engine: RolloutEngine, tokenizer, max_context: int, host: str = "127.0.0.1"):
        if tokenizer.chat_template is None:
            raise ValueError("an agent workflow needs a tokenizer with a chat template: set data.tokenizer=model "
                             "with a model.path whose tokenizer_config.json has a chat_template")
        self.engine, self.tokenizer, self.max_context, self.host = engine, tokenizer, max_context, host
        self.runs: Dict[str, AgentRun] = {}
        self.port: Optional[int] = None
        self._server: Optional[asyncio.base_events.Server] = None

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._connection, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def base_url(self, run_id: str) -> str:
        return f"http://{self.host}:{self.port}/runs/{run_id}/v1"

    def open_run(self, run_id: str, params: SamplingParams) -> AgentRun:
        run = self.runs[run_id] = AgentRun(run_id, replace(params, stream=False))
        return run

    def close_run(self, run_id: str) -> AgentRun:
        return self.runs.pop(run_id)

    # ------------------------------------------------------------------ chat completions
    def encode_prompt(self, run: AgentRun, text: str) -> List[int]:
        """Ids of ``text``: the longest earlier prompt + completion it extends, then the rest."""
        best: Tuple[str, List[int]] = ("", [])
        for prev_text, prev_ids in run.history:
            if len(prev_text) > len(best[0]) and text.startswith(prev_text):
                best = (prev_text, prev_ids)
        rest = text[len(best[0]):]
        return list(best[1]) + (self.tokenizer.encode(rest) if rest else [])

    async def complete(self, run: AgentRun, body: Dict[str, Any]) -> Dict[str, Any]:
        if run.aborted:
            raise RequestError(409, f"run {run.run_id} was aborted by the trainer (a stop or interrupt); "
                               "it will be run again", "aborted")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported by the rollout server; leave it off")
        if body.get("n", 1) != 1:
            raise RequestError(400, "n must be 1 (each call is one turn of one run)")
        try:
            text = self.tokenizer.chat_template.render(messages_for_template(messages), tools=body.get("tools"),
                                                      add_generation_prompt=True)
        except ValueError as err:
            raise RequestError(400, str(err)) from None
        prompt_ids = self.encode_prompt(run, text)
        room = self.max_context - len(prompt_ids)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or run.params.max_new_tokens
        if not isinstance(limit, int) or limit < 1:
            raise RequestError(400, f"max_tokens={limit!r} must be a positive integer")
        max_new = min(limit, run.params.max_new_tokens, room)
        if max_new <= 0:
            raise RequestError(400, f"the conversation is {len(prompt_ids)} tokens; the model's context is "
                               f"{self.max_context} (model.max_position_embeddings)", "context_length_exceeded")
        request_id = f"{run.run_id}-t{len(run.turns)}"
        try:
            out = await whole_response(self.engine.generate(request_id, prompt_ids,
                                                            replace(run.params, max_new_tokens=max_new)))
        except EngineError as err:
            raise RequestError(503, f"the engine failed: {err}", "engine_error") from None
        if out.finish_reason == "abort":
            run.aborted = True
            raise RequestError(409, f"request {request_id} was aborted by the trainer; the run will be run again",
                               "aborted")
        run.turns.append(Turn(prompt_ids, out.token_ids, out.logprobs, out.versions, out.finish_reason,
                              routed_experts=out.routed_experts))
        run.history.append((text + self.tokenizer.decode_with_specials(out.token_ids), prompt_ids + out.token_ids))
        content, tool_calls = parse_tool_calls(self.tokenizer.decode_response(out.token_ids))
        message: Dict[str, Any] = {"role": "assistant", "content": content}
        finish = "length" if out.finish_reason == "length" else "stop"
        if tool_calls:
            message["tool_calls"] = tool_calls
            finish = "tool_calls" if finish == "stop" else finish
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or MODEL_NAME,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.token_ids),
                          "total_tokens": len(prompt_ids) + len(out.token_ids)}}

    async def _route(self, method: str, path: str, body: bytes) -> Dict[str, Any]:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "runs" or parts[2] != "v1":
            raise RequestError(404, f"no route {path}; use the base URL the trainer gave this run")
        run = self.runs.get(parts[1])
        if run is None:
            raise RequestError(404, f"run {parts[1]!r} is not open (it finished or was never started)")
        endpoint = "/".join(parts[3:])
        if endpoint == "models" and method == "GET":
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "megatron_rl"}]}
        if endpoint != "chat/completions":
            raise RequestError(404, f"no endpoint /v1/{endpoint}; this server serves /v1/chat/completions")
        if method != "POST":
            raise RequestError(405, "use POST for /v1/chat/completions")
        try:
            payload = json.loads(body or b"{}")
        except json.JSONDecodeError as err:
            raise RequestError(400, f"the body is not JSON: {err.msg}") from None
        return await self.complete(run, payload)

    # ------------------------------------------------------------------ HTTP/1.1
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await self._read_request(reader)
                if request is None:
                    break
                method, path, body, keep_alive = request
                try:
                    status, answer = 200, await self._route(method, path, body)
                except RequestError as err:
                    status, answer = err.status, {"error": {"message": str(err), "type": err.kind, "code": err.kind}}
                except Exception as err:  # noqa: BLE001 - a server bug answers 500, never kills the run
                    logger.exception("chat server: %s %s failed", method, path)
                    status, answer = 500, {"error": {"message": repr(err), "type": "server_error"}}
                data = json.dumps(answer).encode()
                writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}"
                             "\r\n\r\n".encode() + data)
                await writer.drain()
                if not keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> Optional[Tuple[str, str, bytes, bool]]:
        line = await reader.readline()
        if not line:
            return None
        method, path, version = line.decode("latin-1").split(" ", 2)
        headers: Dict[str, str] = {}
        while True:
            header = await reader.readline()
            if header in (b"\r\n", b"\n", b""):
                break
            name, _, value = header.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
        keep_alive = headers.get("connection", "").lower() != "close" and version.strip() == "HTTP/1.1"
        return method, path, body, keep_alive
