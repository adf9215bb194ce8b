"""Shared helpers for tests that drive the embedded engine."""

import asyncio
from typing import List

from megatron_rl.rollout.workflow import single_turn
from megatron_rl.data.datasets import Prompt
from megatron_rl.types import SamplingParams, Trajectory


async def generate_all(engine, prompts: List[List[int]], params: SamplingParams, tag: str = "r") -> List[Trajectory]:
    jobs = [single_turn(engine, Prompt(f"{tag}{i}", "", ids, ""), 0, params, f"{tag}{i}")
            for i, ids in enumerate(prompts)]
    return list(await asyncio.gather(*jobs))
