"""Workflows turn a prompt into trajectories by talking to an engine, chosen by
``rollout.workflow``: a name in WORKFLOWS (``single_turn``, the example ``calculator_agent``) or
an agent's import path (``my_pkg.agents:MyAgent``, see rollout/agent/)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..registry import Registry
from ..errors import ConfigError
from ..types import GenerationChunk, SamplingParams, Trajectory
from ..api.engine import whole_response
from .group_workflow import Workflow
from .routed_experts import over_positions

if TYPE_CHECKING:  # for annotations only: config validation imports this module for WORKFLOWS
    from ..data.datasets import Prompt
    from ..api.engine import RolloutEngine

# rollout.workflow -> the coroutine function turning one prompt into its group:
# fn(engine, prompt, params, request_ids) -> one Trajectory per request id, in order.
GroupWorkflow = Callable[["RolloutEngine", "Prompt", SamplingParams, Sequence[str]], Awaitable[List[Trajectory]]]
WORKFLOWS: Registry[GroupWorkflow] = Registry("workflow")


class RegisteredWorkflow(Workflow):
    """A WORKFLOWS function as a Workflow."""

    def __init__(self, fn: GroupWorkflow):
        self.fn = fn

    async def __call__(self, engine: "RolloutEngine", prompt: "Prompt", params: SamplingParams,
                       request_ids: Sequence[str]) -> List[Trajectory]:
        return await self.fn(engine, prompt, params, request_ids)


def _trajectory(prompt: Prompt, index: int, response: GenerationChunk,
                prompt_ids: Optional[Sequence[int]] = None) -> Trajectory:
    # The engine's routing as it recorded it: each position's own, never recomputed here.
    routed = over_positions(response.routed_experts, len(prompt.prompt_ids) + len(response.token_ids))
    prompt_ids = list(prompt.prompt_ids) if prompt_ids is None else prompt_ids
    return Trajectory(prompt.uid, index, prompt_ids, response.token_ids, response.logprobs,
                      response.versions, response.finish_reason or "abort", routed_experts=routed)


async def single_turn(engine: RolloutEngine, prompt: Prompt, index: int, params: SamplingParams,
                      request_id: str) -> Trajectory:
    """One response to one prompt; every token keeps its logprob and policy version."""
    return _trajectory(prompt, index, await whole_response(engine.generate(request_id, prompt.prompt_ids, params)))


@WORKFLOWS.register("single_turn")
async def single_turn_group(engine: RolloutEngine, prompt: Prompt, params: SamplingParams,
                            request_ids: Sequence[str]) -> List[Trajectory]:
    """One response per request id to one prompt (a group), as ``single_turn`` each."""
    responses = await engine.generate_n(request_ids, prompt.prompt_ids, params)
    # The group's samples share one read-only array of the prompt (its responses are arrays too).
    prompt_ids = np.asarray(prompt.prompt_ids, dtype=np.int32)
    prompt_ids.flags.writeable = False
    return [_trajectory(prompt, i, r, prompt_ids) for i, r in enumerate(responses)]


async def generate_groups(engine: RolloutEngine, work: Sequence[Tuple[Prompt, int]], params: SamplingParams,
                          tag: str, workflow: str = "single_turn") -> List[List[Trajectory]]:
    """``n`` responses to each (prompt, n), all at once, by ``workflow`` (a WORKFLOWS name);
    request ids ``{tag}-{uid}-{i}``."""
    group = WORKFLOWS.get(workflow)
    return list(await asyncio.gather(*(
        group(engine, prompt, params, [f"{tag}-{prompt.uid}-{i}" for i in range(n)]) for prompt, n in work)))


# Agents by name (classes with ``async run(self, data, ...)`` or ``async def f(data)``
# functions, rollout/agent/spec.py): rollout.workflow=<name> runs one like an import path would.
AGENTS: Registry[Any] = Registry("agent")


def workflow_names() -> Tuple[str, ...]:
    """Every name rollout.workflow accepts (import paths aside)."""
    return WORKFLOWS.names() + AGENTS.names()


def resolve_agent(name: str, args: Optional[Mapping[str, Any]] = None) -> Any:
    """The AgentSpec of ``rollout.workflow``: an import path (``pkg.mod:MyAgent``) or a name in
    AGENTS, a class constructed with ``args`` (``rollout.agent_args``). Raises ValueError
    (PluginError or AgentError) with one line."""
    from ..plugins import is_import_path, load_object
    from .agent import agent_spec

    obj = load_object(name, what="rollout.workflow") if is_import_path(name) else AGENTS.get(name)
    return agent_spec(obj, name, args)


def is_agent(name: str) -> bool:
    from ..plugins import is_import_path

    return is_import_path(name) or name in AGENTS


def build_workflow(name: str, tokenizer: Any = None, max_context: int = 0, turn_discount: float = 1.0,
                   agent_args: Optional[Mapping[str, Any]] = None) -> Workflow:
    """The group workflow ``rollout.workflow`` names; an agent (constructed with ``agent_args``)
    gets a chat server with the tokenizer (its chat template) and the model's context length."""
    if not is_agent(name):
        return RegisteredWorkflow(WORKFLOWS.get(name))
    from .agent import AgentWorkflow

    return AgentWorkflow(resolve_agent(name, agent_args), tokenizer, max_context, turn_discount)


def _register_agents() -> None:
    from .agent.calculator import CalculatorAgent

    AGENTS.add("calculator_agent", CalculatorAgent)


_register_agents()


def check_workflow(rollout_cfg) -> None:
    """An agent workflow (a registered one or a user's import path) loads with rollout.agent_args;
    other workflows take no agent_args."""
    r = rollout_cfg
    if is_agent(r.workflow):
        try:
            resolve_agent(r.workflow, r.agent_args)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    elif r.agent_args:
        raise ConfigError(f"rollout.agent_args={dict(r.agent_args)} is for agents, but "
                          f"rollout.workflow={r.workflow} is not one; drop agent_args or name an agent")
