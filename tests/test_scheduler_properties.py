"""Property tests: the staleness manager and prompt ledger under random interleavings of
generation lengths (long-tailed), reward delays, failures and training times."""

import heapq
import itertools
from collections import Counter

from hypothesis import given, settings, strategies as st

from megatron_rl.data.datasets import Prompt
from megatron_rl.scheduler.ledger import PromptLedger, max_ahead_groups
from megatron_rl.scheduler.staleness import StalenessManager
from megatron_rl.types import Trajectory


def _prompts():
    for i in itertools.count():
        yield Prompt(f"p{i}", "", [1], "")


def _group(ticket, token_version, equal_rewards=False):
    group = [Trajectory(ticket.prompt.uid, i, [1], [2, 3], [-1.0, -1.0], [token_version] * 2, "stop")
             for i in range(2)]
    group[0].reward, group[1].reward = (1.0, 1.0) if equal_rewards else (0.0, 1.0)
    return group


@st.composite
def workloads(draw):
    return dict(
        eta=draw(st.integers(0, 4)),
        ahead=draw(st.sampled_from([0, 1, 1.25, 1.5, 2, 3])),  # scheduler.max_ahead_batches
        filter=draw(st.booleans()),  # algo.filter_groups
        equal_every=draw(st.sampled_from([2, 3, 7])),  # every k-th group has all-equal rewards
        batch=draw(st.integers(1, 4)),
        concurrent=draw(st.integers(1, 24)),
        steps=draw(st.integers(1, 12)),
        # Long-tailed generation times: mostly short, sometimes 50x longer.
        gen=draw(st.lists(st.sampled_from([1, 1, 2, 3, 5, 50]), min_size=1, max_size=40)),
        reward=draw(st.lists(st.integers(0, 5), min_size=1, max_size=40)),
        train=draw(st.lists(st.integers(1, 30), min_size=1, max_size=12)),
        fail=draw(st.lists(st.booleans(), min_size=1, max_size=40)),
        fail_rate=draw(st.sampled_from([0, 0, 5, 3])),  # every k-th admission fails (0: none)
        # Groups may start generating a few versions after admission (queued in the engine).
        queue_delay=draw(st.integers(0, 1)),
        overdue=draw(st.sampled_from(["wait", "retry"])),  # scheduler.overdue
    )


def simulate(w):
    """A discrete-event run of the controller policy; returns what was trained and the ledger."""
    manager = StalenessManager(w["eta"], w["batch"], w["concurrent"])
    ahead_groups = max_ahead_groups(w["ahead"], w["batch"])
    ledger = PromptLedger(_prompts(), manager, max_ahead_groups=ahead_groups,
                          filter_equal_rewards=w["filter"], overdue=w["overdue"])
    clock, version, events, seq = 0, 0, [], itertools.count()
    training = False
    trained_staleness, consumed, filtered = [], Counter(), set()
    steps_done = 0
    pick = lambda xs, i: xs[i % len(xs)]  # noqa: E731

    while steps_done < w["steps"]:
        while (ticket := ledger.admit(version)) is not None:
            i = ticket.index
            failed = w["fail_rate"] and (i + 1) % w["fail_rate"] == 0
            done = clock + pick(w["gen"], i) + pick(w["reward"], i)
            token_version = version + (w["queue_delay"] if i % 2 else 0)
            heapq.heappush(events, (done, next(seq), "fail" if failed else "finish", ticket, token_version))
        if not training:
            batch = ledger.take_batch(version)
            if batch is not None:
                for group in batch:
                    if w["filter"]:  # dynamic sampling: only informative groups are trained
                        assert len({t.reward for t in group.trajectories}) > 1
                    trained_staleness.append(version - group.oldest_version)
                    consumed[group.ticket.prompt.uid] += 1
                training = True
                heapq.heappush(events, (clock + pick(w["train"], steps_done), next(seq), "trained", None, None))
        assert ledger.balanced()
        assert manager.running == ledger.in_flight >= 0
        if w["ahead"]:  # scheduler.max_ahead_batches bounds the work ahead of the learner
            assert ledger.in_flight + len(ledger.buffer) <= ahead_groups
        if not events:
            raise AssertionError(f"deadlock at version {version}: {ledger.counts}")
        clock, _, kind, ticket, token_version = heapq.heappop(events)
        if kind == "finish":
            # A queued group cannot have tokens from a version that does not exist yet.
            equal = (ticket.index + 1) % w["equal_every"] == 0
            if equal and w["filter"]:
                filtered.add(ticket.prompt.uid)
            ledger.finish(ticket, _group(ticket, min(token_version, version), equal))
        elif kind == "fail":
            ledger.fail(ticket, "engine")
        else:
            training = False
            version += 1
            steps_done += 1
    return trained_staleness, consumed, ledger, version, filtered


@settings(max_examples=3000, deadline=None)
@given(workloads())
def test_no_trained_sample_exceeds_eta_nothing_lost_no_deadlock(w):
    staleness, consumed, ledger, version, filtered = simulate(w)
    assert version == w["steps"]
    assert len(staleness) == w["steps"] * w["batch"]
    assert all(0 <= s <= w["eta"] for s in staleness), (staleness, w["eta"])
    assert all(n == 1 for n in consumed.values())  # each prompt trained at most once
    assert ledger.balanced()
    # Every prompt ever admitted is either consumed (once), filtered (dynamic sampling), or still
    # waiting: running, buffered, or returned to the queue for a retry. Exactly one of them.
    waiting = [t.prompt.uid for t in ledger.running.values()]
    waiting += [g.ticket.prompt.uid for g in ledger.buffer]
    waiting += [p.uid for p in ledger.retry_queue]
    assert len(waiting) == len(set(waiting))
    assert not set(waiting) & set(consumed) and not filtered & (set(waiting) | set(consumed))
    assert set(ledger.attempts) == set(waiting) | set(consumed) | filtered
    assert ledger.counts["filtered"] == len(filtered)
    if w["overdue"] == "wait":  # the learner waited instead: no group was dropped for staleness
        assert ledger.counts["returned_stale"] == 0, ledger.counts


def test_eta_zero_generates_one_batch_per_version():
    manager = StalenessManager(max_staleness=0, groups_per_batch=3, max_concurrent=100)
    ledger = PromptLedger(_prompts(), manager)
    tickets = [ledger.admit(0) for _ in range(4)]
    assert [t is not None for t in tickets] == [True, True, True, False]
    for t in tickets[:3]:
        ledger.finish(t, _group(t, 0))
    assert [g.ticket.index for g in ledger.take_batch(0)] == [0, 1, 2]
    assert ledger.admit(0) is None and ledger.admit(1) is not None


def test_failed_group_is_retried_first():
    manager = StalenessManager(max_staleness=1, groups_per_batch=2, max_concurrent=100)
    ledger = PromptLedger(_prompts(), manager)
    first = ledger.admit(0)
    ledger.fail(first, "engine")
    again = ledger.admit(0)
    assert again.prompt.uid == first.prompt.uid and again.attempt == 2
    assert ledger.counts["returned_engine"] == 1 and ledger.balanced()


def test_stale_group_is_evicted_and_retried():
    manager = StalenessManager(max_staleness=1, groups_per_batch=1, max_concurrent=100)
    ledger = PromptLedger(_prompts(), manager)
    old = ledger.admit(0)
    ledger.finish(old, _group(old, 0))
    assert ledger.take_batch(2) is None  # 2 - 0 > η = 1
    assert ledger.counts["returned_stale"] == 1 and list(ledger.retry_queue)[0].uid == old.prompt.uid
    assert manager.accepted == 0 and ledger.balanced()


def test_long_group_is_waited_for_not_dropped():
    """η = 1, one group per batch: a long group admitted at version 0 must be trained at version 1.
    "wait" holds back a short group's batch at version 1 until the long one is done; "retry"
    trains the newer one first and then drops the long one as too stale, the length bias of a
    long-tailed workload."""
    trained = {}
    for overdue in ("wait", "retry"):
        ledger = PromptLedger(_prompts(), StalenessManager(1, 1, 100), overdue=overdue)
        long, short = ledger.admit(0), ledger.admit(0)
        ledger.finish(short, _group(short, 0))
        assert ledger.take_batch(0)[0].ticket is short  # the long one can still make version 1
        newer = ledger.admit(1)
        ledger.finish(newer, _group(newer, 1))
        first = ledger.take_batch(1)
        if overdue == "wait":
            assert first is None and ledger.holding  # training newer now would strand the long one
            ledger.finish(long, _group(long, 0))
            first = ledger.take_batch(1)
        else:
            ledger.finish(long, _group(long, 0))
        second = ledger.take_batch(2)
        trained[overdue] = [g.ticket.prompt.uid for g in (first or []) + (second or [])]
        assert ledger.balanced()
        assert ledger.counts["returned_stale"] == (overdue == "retry")
    assert trained == {"wait": [long.prompt.uid, newer.prompt.uid], "retry": [newer.prompt.uid]}


def test_deadlines_schedule_earliest_first():
    from megatron_rl.scheduler.staleness import schedulable

    assert schedulable([], 5, 2)
    assert schedulable([3, 3, 4, 4], 3, 2)       # two batches: 3 then 4
    assert not schedulable([3, 3, 3], 3, 2)      # three groups due at version 3, two per batch
    assert not schedulable([4, 2], 3, 2)         # one is overdue already
    assert schedulable([9, 4, 4, 5, 5, 9], 4, 2)  # order does not matter


async def _publish_nothing(version):
    pass


def _run_until_stopped(controller, match: str, steps: int = 5) -> None:
    """Run ``controller`` for ``steps`` training steps, expecting it to stop with RolloutsStopped
    matching ``match`` within 30 s (a hang fails the test), then let its rollouts finish."""
    import asyncio

    import pytest

    from megatron_rl.scheduler.controller import RolloutsStopped

    async def on_step(*args):
        pass

    async def run():
        with pytest.raises(RolloutsStopped, match=match):
            await asyncio.wait_for(controller.run(steps, on_step), timeout=30)
        await controller.drain()

    asyncio.run(run())


def test_controller_stops_when_every_group_is_filtered():
    """Dynamic sampling on a task every group ties on: the run stops with RolloutsStopped after
    max_filtered_batches batches' worth of filtered groups instead of admitting forever."""
    import asyncio

    from megatron_rl.scheduler.controller import AsyncController

    manager = StalenessManager(max_staleness=1, groups_per_batch=2, max_concurrent=4)
    ledger = PromptLedger(_prompts(), manager, filter_equal_rewards=True)

    async def rollout(ticket):
        await asyncio.sleep(0)
        return _group(ticket, 0, equal_rewards=True)

    _run_until_stopped(AsyncController(ledger, rollout, lambda batch, v: {}, _publish_nothing, max_filtered_batches=3),
                       "all-equal rewards")
    assert ledger.counts["filtered"] > 3 * 2 and ledger.counts["consumed"] == 0
    assert ledger.balanced()


def test_controller_stops_when_every_group_fails():
    """An engine that answers but fails every request (seen on a GPU: an engine on the wrong
    device): the run stops with RolloutsStopped naming the error after max_failed_batches
    batches' worth of failed groups, every prompt back in the queue, instead of retrying forever.
    One success resets the count."""
    import asyncio

    from megatron_rl.scheduler.controller import AsyncController

    manager = StalenessManager(max_staleness=1, groups_per_batch=2, max_concurrent=4)
    ledger = PromptLedger(_prompts(), manager)
    calls = []

    async def rollout(ticket):
        await asyncio.sleep(0)
        calls.append(ticket.index)
        if len(calls) == 3:  # one success early on resets the streak
            return _group(ticket, 0)
        raise RuntimeError("Expected all tensors to be on the same device")

    _run_until_stopped(AsyncController(ledger, rollout, lambda batch, v: {}, _publish_nothing, max_failed_batches=3),
                       "6 rollout groups in a row failed.*same device")
    assert ledger.counts["returned_error"] >= 2 + 6 and ledger.counts["consumed"] == 0
    assert ledger.balanced()
