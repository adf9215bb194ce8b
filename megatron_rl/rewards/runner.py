"""Score completions in a worker pool with a timeout. A reward that raises, hangs or returns a
value that is not a finite number in range is scored as ``reward.fallback`` with the error counted,
never a dead trainer, and never a process that cannot exit: a hung worker thread is abandoned
(daemon threads, which the interpreter does not wait for at exit)."""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Callable, List, Optional, Sequence, Tuple

from ..plugins import PluginError
from .shaping import overlong_penalty

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]


class AbandonableWorkers:
    """A small thread pool whose threads never hold the process: they are daemons, so a reward
    stuck in a call it never returns from is left behind at exit (``ThreadPoolExecutor`` joins
    its threads at exit, so one hung reward would keep a finished run alive forever). ``submit``
    returns a ``concurrent.futures.Future`` with the usual running / cancel semantics."""

    def __init__(self, workers: int, name: str = "reward"):
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to whoever awaits the future
                future.set_exception(err)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self, cancel_futures: bool = False) -> None:
        """Let the threads go once their current call returns (never waits for one)."""
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)


class RewardRunner:
    def __init__(self, fn: RewardFn, workers: int = 1, timeout_s: float = 10.0, name: str = "reward",
                 fallback: float = 0.0, min_value: Optional[float] = None, max_value: Optional[float] = None):
        self.fn, self.timeout_s, self.name = fn, timeout_s, name
        self.workers = workers
        # The score of a completion whose reward raised, hung or returned an unusable value.
        self.fallback = fallback
        self.min_value, self.max_value = min_value, max_value
        self._pool = AbandonableWorkers(workers)
        self.counts: Counter = Counter()

    async def score(self, completion: str, target: str) -> float:
        """Score one completion without blocking the event loop (``score_many`` of one)."""
        return (await self.score_many([(completion, target)]))[0]

    async def score_many(self, items: Sequence[Tuple[str, str]]) -> List[float]:
        """Score (completion, target) pairs, in order, in one worker call (one hand-off per group
        instead of one per completion, which on a busy event loop is most of the scoring cost).
        A reward that raises scores ``fallback``, counted. A call is hung when no item finishes for
        ``reward.timeout_s`` while it runs: that item scores ``fallback`` (a timeout, counted) and the rest
        go to fresh workers. A call still queued behind a hung one never ran: it moves to the
        fresh workers rather than scoring the fallback."""
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
            logger.warning("%s timed out after %.1fs (reward.timeout_s); scored %s (reward.fallback)", self.name,
                           self.timeout_s, self.fallback)
            if pool is self._pool:  # the hung thread cannot be killed; later calls get fresh workers
                pool.shutdown()
                self._pool = AbandonableWorkers(self.workers)
            scores.append(self.fallback)
        return scores

    def _score_in_order(self, items: Sequence[Tuple[str, str]], done: List[float]) -> None:
        """Worker: score each pair into ``done``; one that raises or returns an unusable value
        scores ``fallback``, counted as an error."""
        for completion, target in items:
            try:
                done.append(self.checked(self.fn(completion, target)))
                self.counts["ok"] += 1
            except PluginError:
                raise  # a user reward.fn that returns the wrong type: stop the run with its one line
            except Exception as err:  # noqa: BLE001 - any user reward error becomes a counted fallback
                self.counts["error"] += 1
                logger.warning("%s failed on completion %r: %s; scored %s (reward.fallback)", self.name,
                               completion[:80], err, self.fallback)
                done.append(self.fallback)

    def checked(self, value) -> float:
        """``value`` as a float when it is a finite number within [min_value, max_value]; raises
        ValueError otherwise (a NaN reward would turn the loss NaN at the next step)."""
        try:
            score = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"returned {value!r}, not a number") from None
        if not math.isfinite(score):
            raise ValueError(f"returned {score}, not a finite number")
        if (self.min_value is not None and score < self.min_value) or (
                self.max_value is not None and score > self.max_value):
            raise ValueError(f"returned {score}, outside [reward.min_value, reward.max_value] = "
                             f"[{self.min_value}, {self.max_value}]")
        return score

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


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
