"""Score completions in worker processes that are killed at the timeout.

A reward is user code or a parser of model output: it may spin, hold the interpreter lock in C
(a catastrophic regex), call ``sys.exit`` or crash. It runs in a pool of worker processes
(``pebble``'s ProcessPool, ``reward.workers`` of them): a reward that raises, hangs, ends its
worker or returns a value that is not a finite number in range is scored ``reward.fallback``
with the error counted, never a dead or frozen trainer. A hung worker is killed and replaced.

Two mistakes stop the run with one line instead, because every later call would repeat them:
a reward that returns the wrong type (a str, None, a list...), and a reward that fails for every
sample of ``max_failing_groups`` groups in a row (a broken reward or data set that would
otherwise train on fallback scores to the end).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections import Counter
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from pebble import ProcessExpired, ProcessPool

from ..plugins import PluginError
from ..types import token_list
from .shaping import overlong_penalty
from .worker import Outcome, RewardInput, RewardLoadError, init_worker, score_items, warm_up

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
# Error warnings logged in full before they are only summarised (a reward broken for a whole
# data set would otherwise write thousands of lines).
LOGGED_ERRORS = 20
# After that, one warning per this many errors.
ERROR_SUMMARY_EVERY = 100


# What the runner scores: a RewardInput, or a plain (completion, target) pair.
Item = Union[RewardInput, Tuple[str, str]]


class Scored(NamedTuple):
    """One completion's score and the extra numbers its reward's dict returned (empty when the
    reward failed)."""

    reward: float
    extras: Dict[str, float]


def as_input(item: Item) -> RewardInput:
    return item if isinstance(item, RewardInput) else RewardInput(item[0], (item[1],))


class RewardFailing(RuntimeError):
    """The reward failed for every sample of many groups in a row; the message is one line."""


def pickled_reward(fn: RewardFn, name: str) -> bytes:
    """``fn`` as the worker processes receive it: by module and name (or, for ``reward.fn``, by
    import path). A lambda or a function defined inside another cannot be sent: PluginError."""
    try:
        return pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise PluginError(f"{name} cannot be sent to a reward worker process ({err}); define it at the top "
                          "level of an importable module (or give it as reward.fn=package.module:function)") from None


def exit_description(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit status {code}"


def read_progress(path: Path) -> List[Outcome]:
    """The outcomes a worker call has written so far (whole lines only)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1]]


class RewardRunner:
    def __init__(self, fn: RewardFn, workers: int = 1, timeout_s: float = 10.0, name: str = "reward",
                 fallback: float = 0.0, min_value: Optional[float] = None, max_value: Optional[float] = None,
                 max_abs: Optional[float] = None, max_failing_groups: Optional[int] = None):
        self.fn, self.timeout_s, self.name = fn, timeout_s, name
        self.workers = workers
        # The score of a completion whose reward raised, hung or returned an unusable value.
        self.fallback = fallback
        self.min_value, self.max_value, self.max_abs = min_value, max_value, max_abs
        # Stop after this many groups in a row whose every sample failed (None: never).
        self.max_failing_groups = max_failing_groups
        self.counts: Counter = Counter()
        self._failing_groups = 0
        self._last_error = ""
        self._payload = pickled_reward(fn, name)
        # A reward.fn reads the prompt, token ids and row; a registered reward only the
        # completion and answers, so only those are sent to its workers.
        self._wants_context = bool(getattr(fn, "wants_context", False))
        # How often a running call's progress is read: a hung call is found within this of
        # reward.timeout_s.
        self._poll_s = min(0.5, max(0.02, timeout_s / 10))
        self._progress_dir = Path(tempfile.mkdtemp(prefix="megatron_rl-rewards-"))
        self._call_ids = itertools.count()
        # Groups waiting for this turn of the event loop to end, and the calls scoring them.
        self._queued: List[Tuple[List[RewardInput], asyncio.Future]] = []
        self._batches: set = set()
        self._closed = False
        self._pool = self._start_pool()

    # ---------------------------------------------------------------- the pool
    def _start_pool(self) -> ProcessPool:
        """Fresh workers (``spawn``: a clean interpreter, not a fork of the trainer's threads),
        started now so that the first group does not wait for them."""
        pool = ProcessPool(max_workers=self.workers, initializer=init_worker, initargs=(os.getpid(),),
                           context=multiprocessing.get_context("spawn"))
        pool.schedule(warm_up, (self._payload,))
        return pool

    def _schedule(self, items: Sequence[RewardInput], path: Path):
        if not self._wants_context:
            items = [RewardInput(item.completion, item.targets) for item in items]
        args = (self._payload, self.name, list(items), str(path))
        # The pool's own limit, a backstop to the watch in _watch (which finds a hang sooner):
        # no call outlives the time its pairs may take, whatever this process is doing.
        hard_limit = self.timeout_s * (len(items) + 1)
        try:
            return self._pool.schedule(score_items, args, timeout=hard_limit)
        except RuntimeError:
            if self._closed:
                raise
            # Every worker was killed from outside (e.g. a TERM to the whole job): a fresh pool.
            logger.warning("%s: the reward worker pool stopped; starting a fresh one", self.name)
            self._stop_pool()
            self._pool = self._start_pool()
            return self._pool.schedule(score_items, args, timeout=hard_limit)

    def close(self) -> None:
        """Kill the workers (a hung one included) and wait for them: none outlives the run."""
        self._closed = True
        self._stop_pool()
        shutil.rmtree(self._progress_dir, ignore_errors=True)

    def _stop_pool(self) -> None:
        self._pool.stop()
        try:
            self._pool.join(timeout=10)
        except TimeoutError:
            logger.warning("%s: reward workers did not stop within 10 s", self.name)

    # ---------------------------------------------------------------- scoring
    async def score(self, completion: str, target: str) -> float:
        """Score one completion without blocking the event loop (``score_many`` of one)."""
        return (await self.score_many([(completion, target)]))[0]

    async def score_many(self, items: Sequence[Item]) -> List[float]:
        """The scores of (completion, target) pairs or RewardInputs, in order (``score_inputs``)."""
        return [scored.reward for scored in await self.score_inputs(items)]

    async def score_inputs(self, items: Sequence[Item]) -> List[Scored]:
        """Score completions, in order, in one worker call (shared with the other groups that ask
        at the same moment). A call is hung when no completion finishes for ``reward.timeout_s``
        while it runs: its worker is killed, that one scores ``fallback`` (a timeout, counted)
        and the rest go to a fresh worker. A wrong return type raises PluginError; RewardFailing
        when every sample of too many groups in a row failed."""
        inputs = [as_input(item) for item in items]
        outcomes = await self._together(inputs)
        scored = [self._score(outcome, item.completion) for outcome, item in zip(outcomes, inputs)]
        if scored:
            self._count_group(all(not ok for _, ok in scored))
        return [result for result, _ in scored]

    def _together(self, items: Sequence[RewardInput]) -> "asyncio.Future[List[Outcome]]":
        """The outcomes of ``items``, scored in one worker call with every other group that asks
        in the same turn of the event loop (the groups one engine step finished): a process
        round trip costs a few thread hand-offs in this busy process, so one per step, not one
        per group. Measured on tiny_cpu (16 groups a step, 2 cores): 0.30 s a step with the
        rewards in threads, 0.35 s with one worker call per group, 0.32 s shared."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._queued.append((list(items), waiter))
        if len(self._queued) == 1:
            loop.call_soon(self._dispatch)
        return waiter

    def _dispatch(self) -> None:
        """One call per worker for the groups queued in this turn (so that several workers
        still score at once)."""
        queued, self._queued = self._queued, []
        share = -(-len(queued) // self.workers)
        for start in range(0, len(queued), share):
            task = asyncio.ensure_future(self._score_batch(queued[start:start + share]))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _score_batch(self, batch: List[Tuple[List[RewardInput], asyncio.Future]]) -> None:
        """Score the groups of ``batch`` in one list and hand each waiter its share."""
        items = [item for group, _ in batch for item in group]
        try:
            outcomes = await self._outcomes(items)
        except asyncio.CancelledError:
            for _, waiter in batch:
                waiter.cancel()
            raise
        except Exception as err:  # noqa: BLE001 - every group of the batch fails the same way
            for _, waiter in batch:
                if not waiter.done():
                    waiter.set_exception(err)
            return
        start = 0
        for group, waiter in batch:
            if not waiter.done():  # a group cancelled meanwhile (the run stopping) takes nothing
                waiter.set_result(outcomes[start:start + len(group)])
            start += len(group)

    async def _outcomes(self, items: Sequence[RewardInput]) -> List[Outcome]:
        """Outcomes of ``items`` in order: calls until every pair has one (a hung or dead call
        returns a prefix; the rest go to the next call). PluginError at a wrong return type."""
        outcomes: List[Outcome] = []
        while len(outcomes) < len(items):
            outcomes += await self._call(items[len(outcomes):])
            for outcome in outcomes:
                if outcome[0] == "stop":
                    raise PluginError(outcome[1])
        return outcomes

    async def _call(self, items: Sequence[RewardInput]) -> List[Outcome]:
        """Outcomes of ``items`` in order from one worker call: all of them, or, when the call
        hung or its worker died, those finished before and the failed one."""
        path = self._progress_dir / f"call-{next(self._call_ids)}.jsonl"
        future = self._schedule(items, path)
        try:
            return await self._watch(future, path)
        finally:
            future.cancel()  # a no-op once done; a call left mid-way (the run stopping) is killed
            path.unlink(missing_ok=True)

    async def _watch(self, future, path: Path) -> List[Outcome]:
        waiting = asyncio.wrap_future(future)
        finished, quiet_since = 0, None
        while True:
            await asyncio.wait({waiting}, timeout=self._poll_s)
            if waiting.done():
                return self._result(waiting, path)
            if not future.running():
                continue  # queued behind other calls: its time has not started
            progress = len(read_progress(path))
            now = time.monotonic()
            if quiet_since is None or progress != finished:
                finished, quiet_since = progress, now
            elif now - quiet_since >= self.timeout_s:
                future.cancel()  # the pool kills the worker and starts a fresh one
                return self._hung(read_progress(path), finished)

    def _result(self, waiting: asyncio.Future, path: Path) -> List[Outcome]:
        try:
            return waiting.result()
        except ProcessExpired as err:  # the reward ended its worker (os._exit, a crash, a signal)
            return read_progress(path) + [["error", f"its worker process died ({exit_description(err.exitcode)})"]]
        except TimeoutError:  # the pool's own limit for the whole call
            done = read_progress(path)
            return self._hung(done, len(done))
        except RewardLoadError as err:
            raise PluginError(f"{self.name} cannot be loaded in a reward worker process ({err}); make its module "
                              "importable there (installed, or its directory on PYTHONPATH)") from None
        except (CancelledError, RuntimeError) as err:  # the pool broke under the call (workers killed)
            return read_progress(path) + [["error", f"its worker pool stopped ({type(err).__name__}: {err})"]]

    def _hung(self, done: List[Outcome], finished: int) -> List[Outcome]:
        if len(done) > finished:
            return done  # the pair finished just as it was given up: the rest go to a fresh worker
        self.counts["timeout"] += 1
        self._last_error = f"timed out after {self.timeout_s:.1f}s"
        logger.warning("%s timed out after %.1fs (reward.timeout_s); scored %s (reward.fallback)", self.name,
                       self.timeout_s, self.fallback)
        return done + [["timeout", None]]

    def _score(self, outcome: Outcome, completion: str) -> Tuple[Scored, bool]:
        """(score, whether the reward succeeded) of one outcome."""
        kind, value = outcome[0], outcome[1]
        if kind == "timeout":
            return Scored(self.fallback, {}), False
        if kind == "ok":
            try:
                score = self.checked(value)
            except ValueError as err:
                value = str(err)
            else:
                self.counts["ok"] += 1
                return Scored(score, outcome[2] if len(outcome) > 2 else {}), True
        self.counts["error"] += 1
        self._last_error = value
        self._warn_error(completion, value)
        return Scored(self.fallback, {}), False

    def _warn_error(self, completion: str, message: str) -> None:
        errors = self.counts["error"]
        if errors <= LOGGED_ERRORS:
            logger.warning("%s failed on completion %r: %s; scored %s (reward.fallback)", self.name,
                           completion[:80], message, self.fallback)
        elif errors % ERROR_SUMMARY_EVERY == 0:
            logger.warning("%s: %d errors so far (the last on %r: %s); each scored %s (reward.fallback)",
                           self.name, errors, completion[:80], message, self.fallback)

    def _count_group(self, every_sample_failed: bool) -> None:
        self._failing_groups = self._failing_groups + 1 if every_sample_failed else 0
        if self.max_failing_groups and self._failing_groups >= self.max_failing_groups:
            raise RewardFailing(
                f"{self.name} failed for every sample of {self.max_failing_groups} groups in a row (the last: "
                f"{self._last_error}); the run stopped. Fix the reward or the data: the errors are in logs/train.log")

    def checked(self, value) -> float:
        """``value`` as a float when it is a finite number within [min_value, max_value] and
        |value| <= max_abs; raises ValueError otherwise (a NaN or huge reward would turn the
        loss non-finite at the next step)."""
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
        if self.max_abs is not None and abs(score) > self.max_abs:
            raise ValueError(f"returned {score}, beyond reward.max_abs={self.max_abs}")
        return score


async def score_groups(runner: RewardRunner, decode: Callable[[List[int]], str], prompts: Sequence[Any],
                       groups: Sequence[Sequence], reward_cfg, max_new_tokens: int) -> None:
    """Set each trajectory's ``reward``: the reward's score of its decoded response against its
    group's prompt (answers, text, ids and dataset row; one worker call per group) plus DAPO's
    overlong penalty; and its ``reward_info`` to the extra numbers the reward returned."""
    scored = await asyncio.gather(*(runner.score_inputs([reward_input(prompt, decode(t.response_ids), t)
                                                         for t in group])
                                    for prompt, group in zip(prompts, groups)))
    for group, results in zip(groups, scored):
        for traj, result in zip(group, results):
            traj.reward = result.reward + overlong_penalty(len(traj.response_ids), max_new_tokens,
                                                           reward_cfg.overlong_buffer, reward_cfg.overlong_penalty)
            traj.reward_info = dict(result.extras)


def reward_input(prompt: Any, completion: str, traj: Any) -> RewardInput:
    """What the reward of one sampled ``traj`` of ``prompt`` (data.datasets.Prompt) is given."""
    return RewardInput(completion, tuple(prompt.acceptable_answers), prompt.text, tuple(token_list(traj.prompt_ids)),
                       tuple(token_list(traj.response_ids)), prompt.ground_truth, dict(prompt.row))
