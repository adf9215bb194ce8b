"""What the driver runs per prompt (``Workflow``): the base of the single-turn workflow
(rollout/workflow.py) and of agents (rollout/agent/), kept apart from both so neither imports
the other for it."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, List, Sequence

from ..types import SamplingParams, Trajectory

if TYPE_CHECKING:
    from ..data.datasets import Prompt
    from ..api.engine import RolloutEngine


class Workflow(abc.ABC):
    """What the driver runs per prompt: ``await workflow(engine, prompt, params, request_ids)``
    gives one Trajectory per request id. ``sets_rewards``: its runs score themselves (agents,
    dataset responses), so the driver calls no reward on them; ``close`` releases what it
    started (an agent's chat server) on the driver's event loop."""

    sets_rewards: bool = False

    @abc.abstractmethod
    async def __call__(self, engine: "RolloutEngine", prompt: "Prompt", params: SamplingParams,
                       request_ids: Sequence[str]) -> List[Trajectory]:
        """The group of ``prompt``: one trajectory per request id, in order."""

    async def close(self) -> None:
        """Release what the workflow started (nothing, unless it says otherwise)."""
