"""A small OpenAI-compatible chat-completions server over a RolloutEngine.

Agents talk to it with the standard ``openai`` client. Each agent run gets its own base URL,
``http://127.0.0.1:<port>/runs/<run id>/v1``, so every call is attributed to its run without
anything in the request body; calls to the shared ``http://127.0.0.1:<port>/v1`` name their run
by a header or by the run's API key (routing.py). A call renders the messages (and ``tools``) with the tokenizer's
chat template, encodes them, generates on the engine under the run's sampling parameters, and
records the exact prompt ids, completion ids, logprobs and per-token policy versions as a
``Turn``. The prompt ids of a call whose text extends an earlier call's prompt + completion reuse
that call's ids and encode only the new text, so a growing conversation stays one token
sequence (re-encoding the model's own answer could split it into different tokens).

Only what agents need is served: ``POST .../chat/completions`` (not streamed) and
``GET .../models``; the model is ``policy`` (``default``, AReaL's name, is taken for it). The run's sampling parameters (``rollout.temperature`` etc.) govern every
call, so the behaviour logprobs are the ones the learner corrects for; a request's ``max_tokens``
(or ``max_completion_tokens``) can only lower the run's ``rollout.max_new_tokens``.

Every call is its own engine request, ``<run id>-t<k>`` with ``k`` counting the run's calls in
the order they arrive, so calls made concurrently inside one run are aborted one by one, and
``abort_run`` reaches all of a run's calls in flight. Every refused request (malformed HTTP, a
body that is not what the API allows, an unknown model) is answered with an HTTP 4xx status and
OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, and
``x-should-retry: false`` (the ``openai`` client would retry a 409 or 5xx, which fails again).
HTTP is aiohttp's
(``http.py``), on the trainer's event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ...types import SamplingParams
from ...api.engine import EngineError, RolloutEngine, whole_response
from .routing import RUN_HEADER, run_of_key
from .tool_calls import messages_for_template, parse_tool_calls
from .trajectories import Turn

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
# Other names a request may give the served model: AReaL's agents ask for "default".
MODEL_ALIASES = ("default",)
# A request body that stops arriving for this long is answered 400 (truncated).
BODY_TIMEOUT_S = 60.0


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


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
    # Engine requests made so far (the next call's id is <run id>-t<calls>) and those in flight.
    calls: int = 0
    in_flight: Set[str] = field(default_factory=set)
    # The run is over (its agent returned or raised): calls still finishing are not recorded.
    closed: bool = False
    # Requests that reached this run (answered or refused): 0 means the agent's client never
    # reached the server. Tool calls the model made, and calls refused for the context length.
    requests: int = 0
    tool_calls: int = 0
    context_overflows: int = 0


def _kind(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean",
                                         int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _positive_int(body: Dict[str, Any], key: str) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(400, f"{key}={json.dumps(value)} is invalid: it must be an integer of at least 1",
                           param=key, code="invalid_value")
    return value


def _check_messages(messages: Any) -> List[Dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, f"'messages' must be a non-empty array of message objects, got "
                           f"{_kind(messages) if messages != [] else 'an empty array'}", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(400, f"{where} must be an object with 'role' and 'content', got {_kind(message)}",
                               param=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(400, f"{where}.role must be a string (system, user, assistant, tool), got "
                               f"{_kind(role)}", param=f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(400, f"{where}.content must be a string, an array of content parts or null, got "
                               f"{_kind(content)}", param=f"{where}.content")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise RequestError(400, f"{where}.content: every content part must be an object like "
                               '{"type": "text", "text": "..."}', param=f"{where}.content")
        calls = message.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function", {}), dict) for c in calls)):
            raise RequestError(400, f"{where}.tool_calls must be an array of objects with a 'function' object",
                               param=f"{where}.tool_calls")
    return messages


def _check_tools(tools: Any) -> Optional[List[Dict[str, Any]]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, f"'tools' must be an array of tool objects, got {_kind(tools)}", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise RequestError(400, f"tools[{i}] must be an object {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"parameters\": ...}}", param=f"tools[{i}]")
    return tools


class ChatServer:
    """``await start()``, then ``open_run(run_id, params)`` per agent run, ``base_url(run_id)`` for
    its client and ``close_run(run_id)`` for its turns."""

    def __init__(self, engine: RolloutEngine, tokenizer, max_context: int, host: str = "127.0.0.1",
                 models: Sequence[str] = (MODEL_NAME,), body_timeout_s: float = BODY_TIMEOUT_S):
        if tokenizer.chat_template is None:
            raise ValueError("an agent workflow needs a tokenizer with a chat template: set data.tokenizer=model "
                             "with a model.path whose tokenizer_config.json has a chat_template")
        self.engine, self.tokenizer, self.max_context, self.host = engine, tokenizer, max_context, host
        self.models, self.body_timeout_s = tuple(models), body_timeout_s
        self.runs: Dict[str, AgentRun] = {}
        self.port: Optional[int] = None
        self._runner = None
        self._aborts: Set[asyncio.Task] = set()
        # Requests that reached any run: 0 while no agent's client has reached the server.
        self.requests = 0

    async def start(self) -> None:
        if self._runner is None:
            from .http import serve

            self._runner, self.port = await serve(self._handle, self.host)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def base_url(self, run_id: str) -> str:
        return f"http://{self.host}:{self.port}/runs/{run_id}/v1"

    def open_run(self, run_id: str, params: SamplingParams) -> AgentRun:
        run = self.runs[run_id] = AgentRun(run_id, replace(params, stream=False))
        return run

    def close_run(self, run_id: str) -> AgentRun:
        run = self.runs.pop(run_id)
        run.closed = True
        return run

    async def abort_run(self, run: AgentRun, void: bool = True) -> None:
        """Abort every engine request of ``run`` still in flight; ``void``: the run is aborted
        (its later calls answer 409 and its group is retried)."""
        if void:
            run.aborted = True
        if run.in_flight:
            await self.engine.abort(sorted(run.in_flight))

    # ------------------------------------------------------------------ chat completions
    def encode_prompt(self, run: AgentRun, text: str) -> List[int]:
        """Ids of ``text``: the longest earlier prompt + completion it extends, then the rest."""
        best: Tuple[str, List[int]] = ("", [])
        for prev_text, prev_ids in run.history:
            if len(prev_text) > len(best[0]) and text.startswith(prev_text):
                best = (prev_text, prev_ids)
        rest = text[len(best[0]):]
        return list(best[1]) + (self.tokenizer.encode(rest) if rest else [])

    def _aborted(self, run: AgentRun, request_id: Optional[str] = None) -> RequestError:
        what = f"request {request_id} of run {run.run_id}" if request_id else f"run {run.run_id}"
        return RequestError(409, f"{what} was aborted by the trainer (a stop or interrupt); the run will be run "
                            "again", "aborted", code="aborted")

    def check(self, body: Any) -> Tuple[List[Dict[str, Any]], Optional[List[Dict[str, Any]]], Optional[int]]:
        """(messages, tools, max tokens asked) of a request body, or RequestError(400)."""
        if not isinstance(body, dict):
            raise RequestError(400, f"the body must be a JSON object (a chat completion request), got {_kind(body)}")
        model = body.get("model")
        if model not in self.models and model not in MODEL_ALIASES:
            served = ", ".join(repr(m) for m in self.models)
            said = "no 'model'" if model is None else f"model {json.dumps(model)}"
            raise RequestError(400, f"{said} is not served here; the served model is {served} (what GET /v1/models "
                               f"lists; {' or '.join(repr(a) for a in MODEL_ALIASES)} names it too)", param="model", code="model_not_found")
        messages = _check_messages(body.get("messages"))
        stream = body.get("stream")
        if stream not in (None, False):
            raise RequestError(400, "stream=true is not supported by the rollout server; leave it off"
                               if stream is True else f"stream must be a boolean, got {_kind(stream)}", param="stream")
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or n != 1):
            raise RequestError(400, "n must be 1 (each call is one turn of one run)", param="n")
        tools = _check_tools(body.get("tools"))
        limits = [v for v in (_positive_int(body, "max_completion_tokens"), _positive_int(body, "max_tokens"))
                  if v is not None]
        return messages, tools, min(limits) if limits else None

    async def complete(self, run: AgentRun, body: Any) -> Dict[str, Any]:
        if run.aborted:
            raise self._aborted(run)
        messages, tools, limit = self.check(body)
        try:
            text = self.tokenizer.chat_template.render(messages_for_template(messages), tools=tools,
                                                      add_generation_prompt=True)
        except (ValueError, TypeError, KeyError, AttributeError) as err:  # the template refused the messages
            raise RequestError(400, str(err) or type(err).__name__, param="messages") from None
        prompt_ids = self.encode_prompt(run, text)
        room = self.max_context - len(prompt_ids)
        max_new = min(limit or run.params.max_new_tokens, run.params.max_new_tokens, room)
        if max_new <= 0:
            run.context_overflows += 1
            raise RequestError(400, f"the conversation is {len(prompt_ids)} tokens; the model's context is "
                               f"{self.max_context} (model.max_position_embeddings)", param="messages",
                               code="context_length_exceeded")
        # One engine request per call, its id taken before the first await: concurrent calls of
        # one run never share an id, so an abort finds each of them.
        request_id = f"{run.run_id}-t{run.calls}"
        run.calls += 1
        run.in_flight.add(request_id)
        try:
            out = await whole_response(self.engine.generate(request_id, prompt_ids,
                                                            replace(run.params, max_new_tokens=max_new)))
        except EngineError as err:
            raise RequestError(503, f"the engine failed: {err}", "engine_error", code="engine_error") from None
        except asyncio.CancelledError:  # the call was given up (the server stopped): stop generating it
            self._abort_later([request_id])
            raise
        finally:
            run.in_flight.discard(request_id)
        if run.closed:  # the agent ended its run without waiting for this call
            raise RequestError(409, f"run {run.run_id} has ended; request {request_id} finished after it and is "
                               "not recorded", "run_closed", code="run_closed")
        if out.finish_reason == "abort":
            # The run is void: its other calls in flight are aborted too, not left generating.
            await self.abort_run(run)
            raise self._aborted(run, request_id)
        if run.aborted:
            raise self._aborted(run, request_id)
        run.turns.append(Turn(prompt_ids, out.token_ids, out.logprobs, out.versions, out.finish_reason,
                              routed_experts=out.routed_experts))
        run.history.append((text + self.tokenizer.decode_with_specials(out.token_ids), prompt_ids + out.token_ids))
        content, tool_calls = parse_tool_calls(self.tokenizer.decode_response(out.token_ids))
        message: Dict[str, Any] = {"role": "assistant", "content": content}
        finish = "length" if out.finish_reason == "length" else "stop"
        if tool_calls:
            run.tool_calls += len(tool_calls)
            message["tool_calls"] = tool_calls
            finish = "tool_calls" if finish == "stop" else finish
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.token_ids),
                          "total_tokens": len(prompt_ids) + len(out.token_ids)}}

    def _abort_later(self, request_ids: List[str]) -> None:
        task = asyncio.ensure_future(self.engine.abort(request_ids))
        self._aborts.add(task)
        task.add_done_callback(lambda t: (self._aborts.discard(t), t.cancelled() or t.exception()))

    # ------------------------------------------------------------------ HTTP
    @property
    def shared_url(self) -> str:
        """The base URL without a run in it (calls name their run by header or key)."""
        return f"http://{self.host}:{self.port}/v1"

    def find_run(self, path: str, headers: Mapping[str, str]) -> Tuple[AgentRun, str]:
        """(run, endpoint) of a request: the run in its path, else in its header, else its key."""
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) >= 4 and parts[0] == "runs" and parts[2] == "v1":
            run_id, endpoint = parts[1], "/".join(parts[3:])
        elif len(parts) >= 2 and parts[0] == "v1":
            endpoint = "/".join(parts[1:])
            auth = headers.get("Authorization", "")
            run_id = headers.get(RUN_HEADER) or run_of_key(auth[len("Bearer "):].strip() if auth.startswith(
                "Bearer ") else "")
            if not run_id:
                raise RequestError(404, f"{path} names no agent run: call from inside a run, with the client, base_url "
                                   "or api_key the trainer hands it, or a client built inside the run (AsyncOpenAI() "
                                   "reads OPENAI_BASE_URL and OPENAI_API_KEY, which point here)", code="no_run")
        else:
            raise RequestError(404, f"no route {path}; use the base URL the trainer gave this run", code="not_found")
        run = self.runs.get(run_id)
        if run is None:
            raise RequestError(404, f"run {run_id!r} is not open (it finished or was never started)",
                               code="not_found")
        run.requests += 1
        self.requests += 1
        return run, endpoint

    async def route(self, method: str, path: str, body: bytes,
                    headers: Mapping[str, str] = MappingProxyType({})) -> Dict[str, Any]:
        """The answer to one request (RequestError for every refusal)."""
        run, endpoint = self.find_run(path, headers)
        if endpoint == "models":
            if method != "GET":
                raise RequestError(405, "use GET for /v1/models", code="method_not_allowed")
            return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "megatron_rl"}
                                               for m in self.models]}
        if endpoint != "chat/completions":
            raise RequestError(404, f"no endpoint /v1/{endpoint}; this server serves /v1/chat/completions and "
                               "/v1/models", code="not_found")
        if method != "POST":
            raise RequestError(405, "use POST for /v1/chat/completions", code="method_not_allowed")
        if not body.strip():
            raise RequestError(400, "the body is empty; send a chat completion request as a JSON object")
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as err:
            raise RequestError(400, f"the body is not JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
        except ValueError:  # not UTF-8
            raise RequestError(400, "the body is not JSON: it is not UTF-8 text") from None
        return await self.complete(run, payload)

    async def _handle(self, request):
        from aiohttp import web

        from .http import json_response, read_body

        unread = True  # the body was not read whole: the connection cannot carry another request
        try:
            try:
                body = await read_body(request, self.body_timeout_s)
                unread = False
            except web.HTTPRequestEntityTooLarge as err:
                raise RequestError(413, f"the body is larger than {err.max_size} bytes", code="body_too_large") \
                    from None
            except ValueError as err:
                raise RequestError(400, str(err), code="malformed_request") from None
            answer, status = await self.route(request.method, request.raw_path, body, request.headers), 200
        except RequestError as err:
            answer, status = err.body(), err.status
            if status >= 500:
                logger.warning("chat server: %s %s: %s", request.method, request.raw_path, err)
        except (ConnectionError, asyncio.IncompleteReadError) as err:
            # The connection was lost mid-body: the answer goes nowhere, the line says why.
            logger.warning("chat server: %s %s: the connection was lost before the whole body arrived (%s)",
                           request.method, request.raw_path, err)
            answer, status = RequestError(400, "the connection was lost before the whole body arrived",
                                          code="malformed_request").body(), 400
        except Exception as err:  # noqa: BLE001 - a server bug answers 500, never kills the run
            logger.exception("chat server: %s %s failed", request.method, request.raw_path)
            answer, status = {"error": {"message": repr(err), "type": "server_error", "param": None,
                                        "code": None}}, 500
        response = json_response(status, answer)
        if status >= 400:  # a retry would be refused again (or, aborted, is the trainer's to make)
            response.headers["x-should-retry"] = "false"
        if unread:
            response.force_close()
        return response
