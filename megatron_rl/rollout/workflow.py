"""Workflows turn a prompt into trajectories by talking to an engine. Single-turn for now."""

from __future__ import annotations

import asyncio
from typing import List, Sequence, Tuple

from ..data.datasets import Prompt
from ..types import GenerationChunk, SamplingParams, Trajectory
from .engine import RolloutEngine, whole_response


def _trajectory(prompt: Prompt, index: int, response: GenerationChunk) -> Trajectory:
    return Trajectory(prompt.uid, index, list(prompt.prompt_ids), response.token_ids, response.logprobs,
                      response.versions, response.finish_reason or "abort")


async def single_turn(engine: RolloutEngine, prompt: Prompt, index: int, params: SamplingParams,
                      request_id: str) -> Trajectory:
    """One response to one prompt; every token keeps its logprob and policy version."""
    return _trajectory(prompt, index, await whole_response(engine.generate(request_id, prompt.prompt_ids, params)))


async def single_turn_group(engine: RolloutEngine, prompt: Prompt, params: SamplingParams,
                            request_ids: Sequence[str]) -> List[Trajectory]:
    """One response per request id to one prompt (a group), as ``single_turn`` each."""
    responses = await engine.generate_n(request_ids, prompt.prompt_ids, params)
    return [_trajectory(prompt, i, r) for i, r in enumerate(responses)]


async def generate_groups(engine: RolloutEngine, work: Sequence[Tuple[Prompt, int]], params: SamplingParams,
                          tag: str) -> List[List[Trajectory]]:
    """``n`` responses to each (prompt, n), all at once; request ids ``{tag}-{uid}-{i}``."""
    return list(await asyncio.gather(*(
        single_turn_group(engine, prompt, params, [f"{tag}-{prompt.uid}-{i}" for i in range(n)]) for prompt, n in work)))
