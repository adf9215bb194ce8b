"""The agent workflow: G runs of a user's agent per prompt, each against its own OpenAI-compatible
base URL on the chat server, turned into token-exact trajectories with the run's reward.

An agent is either

* a class with ``async def run(self, data, client) -> float`` (constructed once, with no
  arguments), handed an ``openai.AsyncOpenAI`` client whose ``base_url`` is the run's, or
* a function ``async def run_agent_return_reward(data) -> float`` that makes its own client
  with ``megatron_rl.rollout.agent.openai_client()`` (or reads ``base_url()``) inside the run.

``data`` is a dict: ``uid``, ``question`` (the dataset's prompt field), ``prompt`` (after
``data.template``) and ``answer`` (the target). Each model call is its own engine request,
tagged ``<group tag>-<i>-t<k>`` (the run's k-th call), so the trainer's abort reaches every call
in flight, concurrent ones included; a run with an aborted call fails its group, whose prompt
goes back to the queue like a single-turn group's.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from ...types import SamplingParams, Trajectory
from ..engine import RolloutEngine
from .server import AgentRun, ChatServer
from .trajectories import run_trajectories

logger = logging.getLogger(__name__)
# The openai client's HTTP library logs every request at INFO: thousands of lines per step.
for _name in ("httpx", "httpx2"):
    logging.getLogger(_name).setLevel(logging.WARNING)

_BASE_URL: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("megatron_rl_agent_base_url", default=None)


class AgentError(ValueError):
    """The user's agent broke its contract (returned no number, made no model call)."""


def base_url() -> str:
    """The OpenAI base URL of the agent run this code runs in."""
    url = _BASE_URL.get()
    if url is None:
        raise RuntimeError("megatron_rl.rollout.agent.base_url() is only available inside an agent run "
                           "(rollout.workflow=<your agent>)")
    return url


def openai_client(**kwargs: Any):
    """An ``openai.AsyncOpenAI`` client pointed at this run's chat server (no retries: a failed
    call means the trainer aborted the run, and a retry would only fail again)."""
    from openai import AsyncOpenAI

    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("api_key", "megatron_rl")
    return AsyncOpenAI(base_url=base_url(), **kwargs)


@dataclass
class AgentSpec:
    """A loaded agent: how to call one run, and its name for messages."""

    name: str
    call: Callable[[Dict[str, Any]], Any]  # data -> awaitable reward (inside a run's context)
    wants_client: bool


def agent_spec(obj: Any, name: str) -> AgentSpec:
    """The AgentSpec of an agent class or function; AgentError with one line when ``obj`` is
    neither (``name`` is the config value, e.g. ``my_pkg.agents:MyAgent``)."""
    where = f"rollout.workflow={name!r}"
    if inspect.isclass(obj):
        run = getattr(obj, "run", None)
        if run is None or not inspect.iscoroutinefunction(run):
            raise AgentError(f"{where}: class {obj.__name__} needs a method `async def run(self, data, client) "
                             "-> float`; add it")
        _check_params(run, ("self", "data", "client"), where, f"{obj.__name__}.run")
        try:
            agent = obj()
        except TypeError as err:
            raise AgentError(f"{where}: {obj.__name__}() failed ({err}); an agent class is constructed with "
                             "no arguments") from None
        return AgentSpec(name, lambda data, client: agent.run(data, client), wants_client=True)
    if inspect.iscoroutinefunction(obj):
        _check_params(obj, ("data",), where, obj.__name__)
        return AgentSpec(name, lambda data, client: obj(data), wants_client=False)
    raise AgentError(f"{where} is a {type(obj).__name__}; point it at an agent class with `async def run(self, "
                     "data, client)` or at a function `async def run_agent_return_reward(data) -> float`")


def _check_params(fn: Callable, params: Sequence[str], where: str, shown: str) -> None:
    try:
        inspect.signature(fn).bind(*params)
    except TypeError:
        raise AgentError(f"{where}: {shown}{inspect.signature(fn)} cannot be called as "
                         f"{shown}({', '.join(params)}); give it exactly these parameters") from None


class AgentWorkflow:
    """A GroupWorkflow (rollout/workflow.py's signature) running ``spec`` once per request id."""

    # The runs score themselves: the trainer does not call reward.name on their trajectories.
    sets_rewards = True

    def __init__(self, spec: AgentSpec, tokenizer, max_context: int, turn_discount: float = 1.0):
        if tokenizer is None or tokenizer.chat_template is None:
            raise AgentError(f"rollout.workflow={spec.name!r} talks to the model in chat messages, so it needs a "
                             "tokenizer with a chat template: set data.tokenizer=model with a model.path (or "
                             "data.tokenizer_path) whose tokenizer_config.json has a chat_template")
        self.spec, self.tokenizer, self.max_context, self.turn_discount = spec, tokenizer, max_context, turn_discount
        self._server: Optional[ChatServer] = None
        self._starting: Optional[asyncio.Lock] = None

    async def server(self, engine: RolloutEngine) -> ChatServer:
        """The chat server over ``engine``, started by the first run that needs it."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._server is None or self._server.engine is not engine:
                if self._server is not None:
                    await self._server.stop()
                server = ChatServer(engine, self.tokenizer, self.max_context)
                await server.start()
                self._server = server
        return self._server

    async def __call__(self, engine: RolloutEngine, prompt, params: SamplingParams,
                       request_ids: Sequence[str]) -> List[Trajectory]:
        server = await self.server(engine)
        # Every run finishes (or fails) before the group does: none is left talking to the engine.
        results = await asyncio.gather(*(self.run_once(server, prompt, params, i, rid)
                                         for i, rid in enumerate(request_ids)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [t for trajs in results for t in trajs]

    async def run_once(self, server: ChatServer, prompt, params: SamplingParams, index: int,
                       request_id: str) -> List[Trajectory]:
        run = server.open_run(request_id, params)
        # The dataset row's fields, with ours (the rendered prompt, the target) set over those of the same name.
        data = {**prompt.row, "uid": prompt.uid, "question": prompt.question or prompt.text,
                "prompt": prompt.text, "answer": prompt.target}
        token = _BASE_URL.set(server.base_url(request_id))
        client = openai_client() if self.spec.wants_client else None
        try:
            reward = await self.spec.call(data, client)
        except Exception:
            if run.aborted:  # the agent saw its aborted call fail: the run is void, not broken
                reward = 0.0
            else:
                raise
        finally:
            _BASE_URL.reset(token)
            server.close_run(request_id)
            # Calls the agent left running (it returned, raised or was cancelled without awaiting
            # them) stop generating; they are not recorded.
            await server.abort_run(run, void=False)
            if client is not None:
                await client.close()
        return self.trajectories(run, prompt, index, reward)

    def trajectories(self, run: AgentRun, prompt, index: int, reward: Any) -> List[Trajectory]:
        if run.aborted:
            return [Trajectory(prompt.uid, index, list(prompt.prompt_ids), [], [], [], "abort")]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise AgentError(f"rollout.workflow={self.spec.name!r}: the agent returned {reward!r} "
                             f"({type(reward).__name__}); it must return the run's reward as a finite float")
        if not run.turns:  # e.g. its first prompt was longer than the context: the group is retried
            raise RuntimeError(f"rollout.workflow={self.spec.name!r}: a run of {prompt.uid} made no model call "
                               "that succeeded, so there is nothing to train on")
        return run_trajectories(run.turns, prompt.uid, index, float(reward), self.turn_discount)
