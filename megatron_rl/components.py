"""A run's parts, as the composition root (build.py) hands them to the driver (trainer.py):
the same whatever the placement. Here, below both, so that neither imports the other for them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, List

from .checkpoint.resume import CountingIterator
from .learner.group import LearnerGroup
from .learner.worker import LearnerWorker
from .rewards import RewardRunner
from .api.engine import RolloutEngine
from .rollout.workflow import Workflow

# ``await run_on_learners(name, *args)``: LearnerWorker.<name>(*args) on every learner rank.
RunOnLearners = Callable[..., Awaitable[Any]]


@dataclass
class PolicyVersion:
    """The policy version the driver last published; components that stamp samples read it."""
    value: int = 0



@dataclass
class Components:
    """A run's parts, whatever the placement."""
    tokenizer: Any
    prompts: CountingIterator               # counted: a resumed run skips what was drawn
    worker: LearnerWorker                   # the driver's learner worker (rank 0's in a world)
    learners: LearnerGroup                  # every learner rank
    learner_executor: ThreadPoolExecutor    # the learner thread: every learner call is made there
    run_on_learners: RunOnLearners          # ``await run_on_learners(name, *args)`` on every rank
    engine: RolloutEngine                   # the engines, one pool
    transport: Any                          # ``await transport.push(version)`` -> sync metrics
    workflow: Workflow
    rewards: RewardRunner
    policy: PolicyVersion
    evaluator: Any = None                   # the eval sets (trainer.eval_interval), else None
    # Engines on ranks of their own (disaggregated): the driver names the run directory to them.
    remote_engines: List[RolloutEngine] = field(default_factory=list)

    def close(self, finished: bool = True) -> None:
        """Release the learner ranks, reward workers, eval sets and the learner thread (after a
        failure the thread may be stuck in a collective with a dead rank: not waited for)."""
        self.learners.close()  # the other learner ranks leave their loop
        self.rewards.close()
        if self.evaluator is not None:
            self.evaluator.close()
        self.learner_executor.shutdown(wait=finished)
