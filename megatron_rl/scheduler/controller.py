"""The asynchronous controller: rollouts run continuously under the staleness rule while the
learner trains on finished groups in another thread; each new version is pushed to the engine.

It knows only callables (a group rollout, a blocking train step, a weight publisher), so the
same loop drives any engine and learner. With η = 0 it generates exactly one batch per version
and reproduces the synchronous loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from typing import Awaitable, Callable, Dict, List, Optional

from ..types import Trajectory
from .ledger import FinishedGroup, PromptLedger, Ticket

logger = logging.getLogger(__name__)

RolloutFn = Callable[[Ticket], Awaitable[List[Trajectory]]]
TrainFn = Callable[[List[FinishedGroup], int], Dict[str, float]]
PublishFn = Callable[[int], Awaitable[None]]
StepFn = Callable[[int, Dict[str, float], List[FinishedGroup]], Awaitable[None]]


class GroupFailed(RuntimeError):
    """A group could not be completed (e.g. a request was aborted); its prompt is retried."""


class RolloutsStopped(RuntimeError):
    """No group can be completed any more (e.g. the engine process died): the run stops with
    this error instead of retrying prompts forever."""


class AsyncController:
    def __init__(self, ledger: PromptLedger, rollout: RolloutFn, train: TrainFn, publish: PublishFn,
                 timeline=None, train_executor: Optional[Executor] = None, max_filtered_batches: int = 20,
                 max_failed_batches: int = 3):
        self.ledger = ledger
        self.rollout = rollout
        self.train = train
        self.publish = publish
        self.timeline = timeline
        # Where the blocking train step runs (None: asyncio's default thread pool).
        self.train_executor = train_executor
        # Stop when this many batches' worth of groups in a row were filtered (DAPO's cap).
        self.max_filtered_batches = max_filtered_batches
        # Stop when this many batches' worth of groups in a row failed (an engine that answers
        # but fails every request): retrying their prompts would loop forever without training.
        self.max_failed_batches = max_failed_batches
        self._failed_streak = 0
        self.version = 0
        self._changed: Optional[asyncio.Condition] = None
        self._tasks: set = set()
        self._stopped: Optional[RolloutsStopped] = None
        self.learner_wait_s = 0.0
        # Of the last step's wait, the seconds its batch was finished but held back for an older
        # running group (scheduler.overdue=wait): what the strict staleness bound costs.
        self.held_s = 0.0

    async def run(self, steps: int, on_step: StepFn, first_step: int = 1) -> None:
        """Train steps ``first_step`` .. ``steps`` (a resumed run starts past 1). ``on_step`` runs
        after each step's weights are published and before new rollouts are admitted under the
        new version, so a checkpoint it writes sees no rollout of the next step at η = 0."""
        self._changed = asyncio.Condition()
        producer = asyncio.create_task(self._produce(), name="rollout-producer")
        try:
            for step in range(first_step, steps + 1):
                wait_start = time.perf_counter()
                batch = await self._next_batch()
                waited = time.perf_counter() - wait_start
                self.learner_wait_s += waited
                start = time.perf_counter()
                metrics = await asyncio.get_running_loop().run_in_executor(
                    self.train_executor, self.train, batch, self.version)
                train_s = time.perf_counter() - start
                start = time.perf_counter()
                # Publish before the version moves: nothing admitted under the new version may
                # start on the old weights.
                await self.publish(self.version + 1)
                metrics["time/sync_s"] = time.perf_counter() - start
                self.version += 1
                metrics.update({"time/train_s": train_s, "time/learner_wait_s": waited,
                                "time/learner_held_s": self.held_s})
                await on_step(step, metrics, batch)
                await self._notify()
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    async def drain(self) -> None:
        """Wait for rollouts still in flight (after their engine was told to abort)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _next_batch(self) -> List[FinishedGroup]:
        self.held_s = 0.0
        async with self._changed:
            while True:
                if self._stopped is not None:
                    raise self._stopped
                batch = self.ledger.take_batch(self.version)
                if batch is not None:
                    return batch
                held_since = time.perf_counter() if self.ledger.holding else None
                await self._changed.wait()
                if held_since is not None:
                    self.held_s += time.perf_counter() - held_since

    async def _produce(self) -> None:
        while self._stopped is None:
            while (ticket := self.ledger.admit(self.version)) is not None:
                task = asyncio.create_task(self._run_group(ticket), name=f"group-{ticket.index}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            async with self._changed:
                await self._changed.wait()

    def _count_failure(self, err: BaseException) -> None:
        self._failed_streak += 1
        limit = self.max_failed_batches * self.ledger.staleness.groups_per_batch
        if self._failed_streak >= limit and self._stopped is None:
            # A workflow's error may say why its groups fail (an agent that never reaches its server).
            why = getattr(err, "streak_hint", None) or ("The engine answers but cannot complete requests: see "
                                                        "logs/train.log for its errors (a wrong device, a model it "
                                                        "cannot run, ...)")
            self._stopped = RolloutsStopped(
                f"{self._failed_streak} rollout groups in a row failed and none succeeded (the last: {err!r}); "
                f"their prompts are back in the queue. {why}")

    async def _run_group(self, ticket: Ticket) -> None:
        try:
            trajectories = await self.rollout(ticket)
        except asyncio.CancelledError:
            self.ledger.fail(ticket, "cancelled")
            raise
        except GroupFailed as err:
            logger.info("group %s returned to the queue: %s", ticket.prompt.uid, err)
            self.ledger.fail(ticket, "aborted")
            self._count_failure(err)
        except RolloutsStopped as err:
            self.ledger.fail(ticket, "stopped")
            self._stopped = err
        except Exception as err:  # noqa: BLE001 - an engine error must not lose the prompt
            logger.warning("group %s failed (%r); prompt returned to the queue", ticket.prompt.uid, err)
            self.ledger.fail(ticket, "error")
            self._count_failure(err)
        else:
            self._failed_streak = 0
            self.ledger.finish(ticket, trajectories)
            limit = self.max_filtered_batches * self.ledger.staleness.groups_per_batch
            if self.ledger.filtered_streak > limit and self._stopped is None:
                self._stopped = RolloutsStopped(
                    f"{self.ledger.filtered_streak} groups in a row had all-equal rewards and were filtered "
                    f"(algo.filter_groups): the task looks solved or hopeless for this policy; disable the "
                    f"filter or change the data")
        await self._notify()
