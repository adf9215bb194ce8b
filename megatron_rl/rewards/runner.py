"""Score completions in a worker pool with a timeout. A reward that raises or hangs is a logged
zero with the error counted, never a dead trainer."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Sequence, Tuple

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]


class RewardRunner:
    def __init__(self, fn: RewardFn, workers: int = 1, timeout_s: float = 10.0, name: str = "reward"):
        self.fn, self.timeout_s, self.name = fn, timeout_s, name
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self.counts: Counter = Counter()

    async def score(self, completion: str, target: str) -> float:
        """Score one completion without blocking the event loop; failures score 0.0, counted.

        A call still queued behind a hung worker when its time runs out never started: it is
        resubmitted to the fresh workers rather than scored as a timeout.
        """
        for _ in range(3):
            future = self._pool.submit(self.fn, completion, target)
            try:
                value = float(await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s))
                self.counts["ok"] += 1
                return value
            except asyncio.TimeoutError:
                if future.cancelled():  # never ran: queued behind a stuck call
                    continue
                self.counts["timeout"] += 1
                logger.warning("%s timed out after %.1fs (reward.timeout_s); scored 0", self.name, self.timeout_s)
                # The hung thread cannot be killed; later scores get fresh workers.
                self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
                return 0.0
            except Exception as err:  # noqa: BLE001 - any user reward error becomes a counted zero
                self.counts["error"] += 1
                logger.warning("%s raised %r on completion %r; scored 0", self.name, err, completion[:80])
                return 0.0
        self.counts["timeout"] += 1
        logger.warning("%s could not get a worker for %.1fs three times; scored 0", self.name, self.timeout_s)
        return 0.0

    async def score_many(self, items: Sequence[Tuple[str, str]]) -> List[float]:
        """Score (completion, target) pairs, in order, in one worker call (one hand-off per group
        instead of one per completion, which on a busy event loop is most of the scoring cost).
        Failures score 0.0, counted, as in ``score``. A call is hung when no item finishes for
        ``reward.timeout_s``: that item scores 0 (a timeout) and the rest go to fresh workers."""
        scores: List[float] = []
        while len(scores) < len(items):
            done: List[float] = []  # the worker appends as it goes: progress the loop can see
            pool = self._pool
            future = pool.submit(self._score_in_order, items[len(scores):], done)
            waiting = asyncio.wrap_future(future)
            seen = 0
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(waiting), self.timeout_s)
                    break
                except asyncio.TimeoutError:
                    if future.running() and len(done) == seen:
                        break  # hung on the item after the last one done
                    if pool is not self._pool and future.cancel():
                        break  # queued behind a call that hung: resubmit to the fresh workers
                    seen = len(done)
            scores += done
            if future.done():
                continue  # finished, or cancelled before it started
            self.counts["timeout"] += 1
            logger.warning("%s timed out after %.1fs (reward.timeout_s); scored 0", self.name, self.timeout_s)
            if pool is self._pool:  # the hung thread cannot be killed; later calls get fresh workers
                pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
            scores.append(0.0)
        return scores

    def _score_in_order(self, items: Sequence[Tuple[str, str]], done: List[float]) -> None:
        """Worker: score each pair into ``done`` (a zero, counted, for one that raises)."""
        for completion, target in items:
            try:
                done.append(float(self.fn(completion, target)))
                self.counts["ok"] += 1
            except Exception as err:  # noqa: BLE001 - any user reward error becomes a counted zero
                self.counts["error"] += 1
                logger.warning("%s raised %r on completion %r; scored 0", self.name, err, completion[:80])
                done.append(0.0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def score_groups(runner: RewardRunner, decode: Callable[[List[int]], str], targets: Sequence[str],
                       groups: Sequence[Sequence], reward_cfg, max_new_tokens: int) -> None:
    """Set each trajectory's ``reward``: the verifier's score of its decoded response against its
    group's target (one worker call per group) plus DAPO's overlong penalty."""
    from .shaping import overlong_penalty

    scored = await asyncio.gather(*(runner.score_many([(decode(t.response_ids), target) for t in group])
                                    for target, group in zip(targets, groups)))
    for group, scores in zip(groups, scored):
        for traj, score in zip(group, scores):
            traj.reward = score + overlong_penalty(len(traj.response_ids), max_new_tokens,
                                                   reward_cfg.overlong_buffer, reward_cfg.overlong_penalty)
