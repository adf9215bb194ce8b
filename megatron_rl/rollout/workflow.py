"""Workflows turn a prompt into trajectories by talking to an engine, registered by
``rollout.workflow`` in WORKFLOWS. Single-turn for now."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable, List, Sequence, Tuple

from ..registry import Registry
from ..types import GenerationChunk, SamplingParams, Trajectory
from .engine import whole_response

if TYPE_CHECKING:  # for annotations only: config validation imports this module for WORKFLOWS
    from ..data.datasets import Prompt
    from .engine import RolloutEngine

# rollout.workflow -> the coroutine function turning one prompt into its group:
# fn(engine, prompt, params, request_ids) -> one Trajectory per request id, in order.
GroupWorkflow = Callable[["RolloutEngine", "Prompt", SamplingParams, Sequence[str]], Awaitable[List[Trajectory]]]
WORKFLOWS: Registry[GroupWorkflow] = Registry("workflow")


def _trajectory(prompt: Prompt, index: int, response: GenerationChunk) -> Trajectory:
    return Trajectory(prompt.uid, index, list(prompt.prompt_ids), response.token_ids, response.logprobs,
                      response.versions, response.finish_reason or "abort")


async def single_turn(engine: RolloutEngine, prompt: Prompt, index: int, params: SamplingParams,
                      request_id: str) -> Trajectory:
    """One response to one prompt; every token keeps its logprob and policy version."""
    return _trajectory(prompt, index, await whole_response(engine.generate(request_id, prompt.prompt_ids, params)))


@WORKFLOWS.register("single_turn")
async def single_turn_group(engine: RolloutEngine, prompt: Prompt, params: SamplingParams,
                            request_ids: Sequence[str]) -> List[Trajectory]:
    """One response per request id to one prompt (a group), as ``single_turn`` each."""
    responses = await engine.generate_n(request_ids, prompt.prompt_ids, params)
    return [_trajectory(prompt, i, r) for i, r in enumerate(responses)]


async def generate_groups(engine: RolloutEngine, work: Sequence[Tuple[Prompt, int]], params: SamplingParams,
                          tag: str, workflow: str = "single_turn") -> List[List[Trajectory]]:
    """``n`` responses to each (prompt, n), all at once, by ``workflow`` (a WORKFLOWS name);
    request ids ``{tag}-{uid}-{i}``."""
    group = WORKFLOWS.get(workflow)
    return list(await asyncio.gather(*(
        group(engine, prompt, params, [f"{tag}-{prompt.uid}-{i}" for i in range(n)]) for prompt, n in work)))
