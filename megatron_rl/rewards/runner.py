"""Score completions in a worker pool with a timeout. A reward that raises or hangs is a logged
zero with the error counted, never a dead trainer."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
