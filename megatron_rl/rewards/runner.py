"""Score completions in a worker pool with a timeout. A reward that raises or hangs is a logged
zero with the error counted, never a dead trainer."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Sequence, Tuple

from ..plugins import PluginError
from .shaping import overlong_penalty

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]


class RewardRunner:
    def __init__(self, fn: RewardFn, workers: int = 1, timeout_s: float = 10.0, name: str = "reward"):
        self.fn, self.timeout_s, self.name = fn, timeout_s, name
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self.counts: Counter = Counter()

    async def score(self, completion: str, target: str) -> float:
        """Score one completion without blocking the event loop (``score_many`` of one)."""
        return (await self.score_many([(completion, target)]))[0]

    async def score_many(self, items: Sequence[Tuple[str, str]]) -> List[float]:
        """Score (completion, target) pairs, in order, in one worker call (one hand-off per group
        instead of one per completion, which on a busy event loop is most of the scoring cost).
        A reward that raises scores 0.0, counted. A call is hung when no item finishes for
        ``reward.timeout_s`` while it runs: that item scores 0 (a timeout, counted) and the rest
        go to fresh workers. A call still queued behind a hung one never ran: it moves to the
        fresh workers rather than scoring 0."""
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
            except PluginError:
                raise  # a user reward.fn that returns the wrong type: stop the run with its one line
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
    scored = await asyncio.gather(*(runner.score_many([(decode(t.response_ids), target) for t in group])
                                    for target, group in zip(targets, groups)))
    for group, scores in zip(groups, scored):
        for traj, score in zip(group, scores):
            traj.reward = score + overlong_penalty(len(traj.response_ids), max_new_tokens,
                                                   reward_cfg.overlong_buffer, reward_cfg.overlong_penalty)
