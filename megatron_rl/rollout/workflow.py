"""Workflows turn a prompt into trajectories by talking to an engine. Single-turn for now."""

from __future__ import annotations

from typing import List

from ..data.datasets import Prompt
from ..types import SamplingParams, Trajectory
from .engine import RolloutEngine


async def single_turn(engine: RolloutEngine, prompt: Prompt, index: int, params: SamplingParams,
                      request_id: str) -> Trajectory:
    """One response to one prompt; every token keeps its logprob and policy version."""
    tokens: List[int] = []
    logprobs: List[float] = []
    versions: List[int] = []
    finish = "abort"
    async for chunk in engine.generate(request_id, prompt.prompt_ids, params):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        if chunk.finish_reason is not None:
            finish = chunk.finish_reason
    return Trajectory(prompt.uid, index, list(prompt.prompt_ids), tokens, logprobs, versions, finish)
