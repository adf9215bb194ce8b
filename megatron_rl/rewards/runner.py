"""Score completions in a worker pool with a timeout. A reward that raises or hangs is a logged
zero with the error counted, never a dead trainer."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Callable, List, Sequence, Tuple

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]


class RewardRunner:
    def __init__(self, fn: RewardFn, workers: int = 1, timeout_s: float = 10.0, name: str = "reward"):
        self.fn, self.timeout_s, self.name = fn, timeout_s, name
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self.counts: Counter = Counter()

    def score_many(self, items: Sequence[Tuple[str, str]]) -> List[float]:
        """Scores for (completion, target) pairs, in order; failures score 0.0 and are counted."""
        futures = [self._pool.submit(self.fn, completion, target) for completion, target in items]
        scores = []
        for i, (completion, _) in enumerate(items):
            try:
                value = float(futures[i].result(timeout=self.timeout_s))
                self.counts["ok"] += 1
            except FutureTimeout:
                self.counts["timeout"] += 1
                logger.warning("%s timed out after %.1fs (reward.timeout_s); scored 0", self.name, self.timeout_s)
                self._replace_stuck_pool(futures, items, i + 1)
                value = 0.0
            except Exception as err:  # noqa: BLE001 - any user reward error becomes a counted zero
                self.counts["error"] += 1
                logger.warning("%s raised %r on completion %r; scored 0", self.name, err, completion[:80])
                value = 0.0
            scores.append(value)
        return scores

    async def score(self, completion: str, target: str) -> float:
        """Score one completion without blocking the event loop; failures score 0.0, counted."""
        future = self._pool.submit(self.fn, completion, target)
        try:
            value = float(await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s))
            self.counts["ok"] += 1
            return value
        except asyncio.TimeoutError:
            self.counts["timeout"] += 1
            logger.warning("%s timed out after %.1fs (reward.timeout_s); scored 0", self.name, self.timeout_s)
            # The hung thread cannot be killed; later scores get fresh workers.
            self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
        except Exception as err:  # noqa: BLE001 - any user reward error becomes a counted zero
            self.counts["error"] += 1
            logger.warning("%s raised %r on completion %r; scored 0", self.name, err, completion[:80])
        return 0.0

    def _replace_stuck_pool(self, futures: list, items: Sequence[Tuple[str, str]], start: int) -> None:
        # A hung thread cannot be killed: move the items still waiting behind it to fresh workers.
        self._pool.shutdown(wait=False)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
        for j in range(start, len(items)):
            if futures[j].cancel():
                futures[j] = self._pool.submit(self.fn, *items[j])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
