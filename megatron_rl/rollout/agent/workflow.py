"""The agent workflow: G runs of a user's agent per prompt, each against its own OpenAI-compatible
base URL on the chat server, turned into token-exact trajectories with the run's reward.

What an agent may look like and what a run is handed: spec.py. ``data`` is a dict: every column
of the prompt's dataset row, then ``uid``, ``question`` (the dataset's prompt field), ``prompt``
(after ``data.template``) and ``answer`` (the target), which no column overrides, and
``messages`` (the question as one user message, unless the row has its own), which AReaL's
agents read. Each model call is its own engine request, tagged ``<group tag>-<i>-t<k>`` (the
run's k-th call), so the trainer's abort reaches every call in flight, concurrent ones included;
a run with an aborted call fails its group, whose prompt goes back to the queue like a
single-turn group's.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import logging
import math
from typing import Any, Callable, Dict, List, Optional, Sequence

from ...errors import one_line
from ...types import SamplingParams, Trajectory
from ...api.engine import RolloutEngine
from ..group_workflow import Workflow
from . import routing
from .server import AgentRun, ChatServer
from .spec import AgentError, AgentSpec
from .trajectories import run_trajectories

logger = logging.getLogger(__name__)
# The openai client's HTTP library logs every request at INFO: thousands of lines per step.
for _name in ("httpx", "httpx2"):
    logging.getLogger(_name).setLevel(logging.WARNING)

# How a run's client reaches the server, for the message of an agent that never does.
REACH = ("use the client, base_url or api_key handed to the run, megatron_rl.rollout.agent.openai_client(), or an "
         "AsyncOpenAI() built inside the run without base_url and api_key (OPENAI_BASE_URL and OPENAI_API_KEY point "
         "at the chat server while agents run); docs/agents.md")


class AgentRunFailed(RuntimeError):
    """One run failed and its group goes back to the queue; ``streak_hint`` says why for the
    message of a run stopped by many such failures in a row."""

    def __init__(self, message: str, streak_hint: Optional[str] = None):
        super().__init__(message)
        self.streak_hint = streak_hint


def base_url() -> str:
    """The OpenAI base URL of the agent run this code runs in."""
    run = routing.current()
    if run is None:
        raise RuntimeError("megatron_rl.rollout.agent.base_url() is only available inside an agent run "
                           "(rollout.workflow=<your agent>)")
    return run.base_url


def openai_client(**kwargs: Any):
    """An ``openai.AsyncOpenAI`` client pointed at this run's chat server (no retries: a failed
    call means the trainer aborted the run, and a retry would only fail again)."""
    from openai import AsyncOpenAI

    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("api_key", routing.run_key(routing.current().run_id) if routing.current() else "megatron_rl")
    return AsyncOpenAI(base_url=base_url(), **kwargs)


def http_client():
    """A fresh async HTTP client for ``AsyncOpenAI(http_client=...)``: the ``httpx2`` flavour
    that ``openai`` sends with (``httpx`` where that is missing), without a timeout (a call
    waits for the engine; the trainer aborts what must stop)."""
    try:
        module = importlib.import_module("httpx2")
    except ImportError:
        module = importlib.import_module("httpx")
    return module.AsyncClient(timeout=None)


def run_data(prompt) -> Dict[str, Any]:
    """What an agent run is handed as ``data`` (a copy per run: an agent may change it)."""
    data = copy.deepcopy(dict(getattr(prompt, "row", None) or {}))
    question = prompt.question or prompt.text
    data.update(uid=prompt.uid, question=question, prompt=prompt.text, answer=prompt.target)
    data.setdefault("messages", [{"role": "user", "content": question}])
    return data


def _is_connection_failure(err: BaseException) -> bool:
    """An HTTP client's failure (openai's errors, a refused or failed connection), not the
    agent's own (a KeyError, a missing file)."""
    if isinstance(err, ConnectionError):
        return True
    for module_name, name in (("openai", "OpenAIError"), ("httpx2", "TransportError"), ("httpx", "TransportError"),
                              ("aiohttp", "ClientConnectionError")):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        kind = getattr(module, name, None)
        if kind is not None and isinstance(err, kind):
            return True
    return False


class AgentWorkflow(Workflow):
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
        self._restore_env: Optional[Callable[[], None]] = None

    async def server(self, engine: RolloutEngine) -> ChatServer:
        """The chat server over ``engine``, started by the first run that needs it; while it
        runs, clients built from the environment reach it (routing.py)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._server is None or self._server.engine is not engine:
                await self._stop_server()
                server = ChatServer(engine, self.tokenizer, self.max_context)
                await server.start()
                routing.install_run_header()
                self._restore_env = routing.point_environment(server.shared_url)
                self._server = server
        return self._server

    async def _stop_server(self) -> None:
        if self._restore_env is not None:
            self._restore_env()
            self._restore_env = None
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop()

    async def close(self) -> None:
        """Stop the chat server and give the environment back its OPENAI_* variables."""
        await self._stop_server()

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
        address = routing.RunAddress(server.host, server.port, request_id)
        # This task's (and its children's) calls are this run's, whatever client makes them.
        token = routing.enter(address)
        wants = self.spec.wants
        handed: Dict[str, Any] = {"base_url": address.base_url, "api_key": address.api_key}
        try:
            if "http_client" in wants:
                handed["http_client"] = http_client()
            if "client" in wants:
                handed["client"] = openai_client()
            reward = await self.spec.call(run_data(prompt), handed)
        except Exception as err:
            if run.aborted:  # the agent saw its aborted call fail: the run is void, not broken
                reward = 0.0
            elif run.requests == 0:
                raise self._unreached(err, server, prompt) from err
            else:
                raise
        finally:
            routing.leave(token)
            server.close_run(request_id)
            # Calls the agent left running (it returned, raised or was cancelled without awaiting
            # them) stop generating; they are not recorded.
            await server.abort_run(run, void=False)
            for name in ("client", "http_client"):
                if name in handed:
                    await (handed[name].close() if name == "client" else handed[name].aclose())
        return self.trajectories(run, prompt, index, reward)

    def _unreached(self, err: Exception, server: ChatServer, prompt) -> Exception:
        """The error of a run that raised before any of its calls reached the chat server: a
        stop when it is a client's failure and no run has reached the server yet (its client
        is pointed elsewhere, and every run's is), else a failed group saying so."""
        what = f"{type(err).__name__}: {one_line(err)}"[:500]
        where = f"rollout.workflow={self.spec.name!r}"
        if server.requests == 0 and _is_connection_failure(err):
            return AgentError(f"{where}: the agent's model calls never reached the chat server ({what}); {REACH}")
        return AgentRunFailed(f"{where}: a run of {prompt.uid} raised {what} before any of its calls reached the chat "
                              "server", streak_hint=f"the agent's runs failed before any of their calls reached the "
                              f"chat server: {REACH}; the agent's errors are in logs/train.log")

    def trajectories(self, run: AgentRun, prompt, index: int, reward: Any) -> List[Trajectory]:
        if run.aborted:
            return [Trajectory(prompt.uid, index, list(prompt.prompt_ids), [], [], [], "abort")]
        where = f"rollout.workflow={self.spec.name!r}"
        if isinstance(reward, dict):
            raise AgentError(f"{where}: the agent returned a dict ({len(reward)} entries; rewards per completion, as "
                             "AReaL allows); return the run's reward as one finite float")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise AgentError(f"{where}: the agent returned {reward!r} ({type(reward).__name__}); it must return the "
                             "run's reward as a finite float")
        if not run.turns:
            if run.requests == 0:  # it returned without ever reaching the server
                raise AgentRunFailed(f"{where}: a run of {prompt.uid} returned {reward!r} but none of its calls reached "
                                     "the chat server, so there is nothing to train on",
                                     streak_hint=f"the agent's runs made no call that reached the chat server: {REACH}")
            # e.g. its first prompt was longer than the context: the group is retried
            raise RuntimeError(f"{where}: a run of {prompt.uid} made no model call that succeeded, so there is "
                               "nothing to train on")
        trajectories = run_trajectories(run.turns, prompt.uid, index, float(reward), self.turn_discount)
        counts = {"turns": len(run.turns), "tool_calls": run.tool_calls, "context_overflows": run.context_overflows,
                  "trajectories": len(trajectories)}
        for traj in trajectories:
            traj.agent_run = counts
        return trajectories
