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


def kill_engine_after_step(trainer, step: int, pids) -> None:
    """Make ``trainer`` SIGKILL the processes ``pids()`` returns right after training step ``step``
    (its metrics and checkpoint hooks run first), as a crash of the engine mid-run."""
    import os
    import signal

    real_after_step = trainer.after_step

    async def after_step(done: int, *args):
        await real_after_step(done, *args)
        if done == step:
            for pid in pids():
                os.kill(pid, signal.SIGKILL)

    trainer.after_step = after_step
