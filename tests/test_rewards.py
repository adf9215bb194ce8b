"""Verifiable rewards and the runner that survives raising and hanging reward functions."""

import time

import pytest

from megatron_rl.rewards import RewardRunner, digit_match, gsm8k_exact
from reward_functions import flaky


@pytest.mark.parametrize(
    "completion, target, expected",
    [("321", "321", 1.0), ("320", "321", 3 / 4), ("3210", "321", 3 / 5), ("3", "321", 1 / 4),
     ("", "321", 0.0), (" 321 ", "321", 1.0), ("123", "321", 2 / 4), ("999", "321", 1 / 4),
     ("99999", "321", 0.0)],
)
def test_digit_match(completion, target, expected):
    assert digit_match(completion, target) == pytest.approx(expected)


@pytest.mark.parametrize(
    "completion, expected",
    [("so it is 72.\n#### 72", 1.0), ("#### 72.0", 1.0), ("#### 1,072", 0.0), ("72", 0.0),
     ("#### 7 then #### 72", 1.0), ("#### seventy", 0.0)],
)
def test_gsm8k_exact(completion, expected):
    assert gsm8k_exact(completion, "72") == expected


def test_gsm8k_thousands():
    assert gsm8k_exact("#### 1,072", "1072") == 1.0


def test_async_score_survives_raise_and_hang():
    import asyncio

    # One worker: the calls queued behind the hang must still be scored, not timed out.
    runner = RewardRunner(flaky, workers=1, timeout_s=0.3)

    async def run():
        return await asyncio.gather(*(runner.score(c, "") for c in ["ok", "boom", "hang", "ok2"]))

    start = time.perf_counter()
    assert asyncio.run(run()) == [1.0, 0.0, 0.0, 1.0]  # in order, failures are zeros
    assert time.perf_counter() - start < 15  # the hang sleeps 30 s; a fresh worker starts in ~1 s
    assert runner.counts["timeout"] == 1 and runner.counts["error"] == 1 and runner.counts["ok"] == 2
    # Still serving after the hang: fresh workers took over.
    assert asyncio.run(run()) == [1.0, 0.0, 0.0, 1.0]
    runner.close()


def test_overlong_penalty_by_hand():
    from megatron_rl.rewards.shaping import overlong_penalty

    # L_max = 20, L_cache = 4: free up to 16, then -1/4 per token, -1 at 20 and beyond.
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20, 25)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(18, 20, 4, factor=0.5) == -0.25
    assert overlong_penalty(20, 20, 0) == 0.0  # disabled
    with pytest.raises(ValueError, match="exceeds the maximum length"):
        overlong_penalty(5, 4, 8)


def test_score_many_survives_raise_and_hang_in_one_call():
    """A group scored in one worker call: a raise is a counted zero, a hang is a counted timeout
    after reward.timeout_s without progress (its worker killed), and the items after it are
    still scored by a fresh worker."""
    import asyncio

    runner = RewardRunner(flaky, workers=1, timeout_s=0.5)
    items = [("ok", "o"), ("boom", ""), ("slow", "s"), ("slow", "s"), ("slow", "s"), ("hang", ""), ("ok2", "x")]
    start = time.perf_counter()
    assert asyncio.run(runner.score_many(items)) == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5]
    assert time.perf_counter() - start < 15  # the hang sleeps 30 s; a fresh worker starts in ~1 s
    assert runner.counts["timeout"] == 1 and runner.counts["error"] == 1 and runner.counts["ok"] == 5
    # Fresh workers took over; a second group behind nothing hung is scored normally.
    assert asyncio.run(runner.score_many([("ok", "o"), ("ok", "z")])) == [1.0, 0.5]
    runner.close()


def test_score_many_queued_behind_a_hang_is_scored_by_fresh_workers():
    import asyncio

    runner = RewardRunner(flaky, workers=1, timeout_s=0.3)

    async def two_groups():
        return await asyncio.gather(runner.score_many([("a", ""), ("hang", "")]),
                                    runner.score_many([("b", ""), ("c", "")]))

    start = time.perf_counter()
    assert asyncio.run(two_groups()) == [[1.0, 0.0], [1.0, 1.0]]
    assert time.perf_counter() - start < 15  # the hang sleeps 30 s; a fresh worker starts in ~1 s
    assert runner.counts["timeout"] == 1
    runner.close()


def test_a_call_queued_behind_a_hang_is_scored_not_timed_out():
    """score() is score_many of one, and keeps what it did on its own: a completion still waiting
    for the only worker when the call ahead of it hangs moves to fresh workers and is scored."""
    import asyncio

    runner = RewardRunner(flaky, workers=1, timeout_s=0.3)

    async def run():
        return await asyncio.gather(runner.score("hang", ""), runner.score("ok", ""))

    assert asyncio.run(run()) == [0.0, 1.0]
    assert runner.counts["timeout"] == 1 and runner.counts["ok"] == 1
    runner.close()
