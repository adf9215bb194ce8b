"""Embedded engine behaviour: EOS and length stops, abort, pause/update/resume with versions."""

import asyncio

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.api.engine import EngineError
from megatron_rl.types import SamplingParams

from engine_helpers import generate_all

VOCAB = 32


@pytest.fixture
def engine(megatron_world):
    torch.manual_seed(0)
    return EmbeddedEngine(ModelConfig(), VOCAB, max_batch_size=8, seed=0)


def _biased_weights(engine: EmbeddedEngine, token: int):
    """HF tensors that make the model emit ``token`` whatever the input: attention and MLP
    outputs are zeroed, so the final hidden state is the (all-ones) embedding, and only the LM
    head row of ``token`` sees it (logit = hidden_size, every other logit 0)."""
    from megatron_rl.models.hf_names import megatron_to_hf

    hf = {}
    for name, t in engine.model.state_dict().items():
        if isinstance(t, torch.Tensor):
            hf.update(megatron_to_hf(name, t.clone(), engine.model_cfg))
    for name, t in hf.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
            t.zero_()
        elif name.endswith(("embed_tokens.weight", "norm.weight")):
            t.fill_(1.0)
    hf["lm_head.weight"][token] = 1.0
    return hf


def test_length_stop_and_mixed_prompt_lengths_share_a_batch(engine):
    params = SamplingParams(max_new_tokens=5)
    trajs = asyncio.run(generate_all(engine, [[1, 2], [1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], params))
    assert [t.finish_reason for t in trajs] == ["length"] * 4
    assert all(len(t.response_ids) == 5 and len(t.logprobs) == 5 for t in trajs)
    assert engine.stats.prefills == 1  # left padding: one batch for all prompt lengths


def test_eos_stop(engine):
    async def run():
        await engine.pause()
        await engine.update_weights(_biased_weights(engine, token=3).items(), version=1)
        await engine.resume()
        stop = SamplingParams(max_new_tokens=20, stop_token_ids=(3,))
        return await generate_all(engine, [[1, 2, 5]] * 3, stop)

    for t in asyncio.run(run()):
        assert t.finish_reason == "stop" and t.response_ids == [3] and t.versions == [1]


def test_update_weights_requires_pause(engine):
    async def run():
        await engine.resume()
        with pytest.raises(EngineError, match="paused engine"):
            await engine.update_weights([], version=1)

    asyncio.run(run())


def test_abort_pending_and_running(engine):
    async def run():
        params = SamplingParams(max_new_tokens=25)

        async def consume(rid, ids, abort_after_first=False):
            out = []
            async for chunk in engine.generate(rid, ids, params):
                out.append(chunk)
                if abort_after_first and len(out) == 1:
                    await engine.abort([rid])
            return out

        running = [asyncio.create_task(consume("a0", [1, 2, 3])),
                   asyncio.create_task(consume("a1", [1, 2, 3], abort_after_first=True)),
                   asyncio.create_task(consume("a2", [1, 2, 3]))]
        await asyncio.sleep(0)
        pending = asyncio.create_task(consume("p0", [4, 5]))  # arrives mid-batch: waits its turn
        await asyncio.sleep(0)
        await engine.abort(["p0"])
        results = await asyncio.gather(*running, pending)
        await engine.shutdown()
        return results

    a0, a1, a2, p0 = asyncio.run(run())
    assert a0[-1].finish_reason == "length" and a2[-1].finish_reason == "length"
    assert a1[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in a1) < 25
    assert len(p0) == 1 and p0[0].finish_reason == "abort" and p0[0].token_ids == []


@pytest.mark.parametrize("recompute", [True, False])
def test_pause_update_resume_tags_tokens_with_versions(engine, recompute):
    engine._recompute_kv_on_update = recompute

    async def run():
        params = SamplingParams(max_new_tokens=25)
        chunks = []

        async def consume():
            async for chunk in engine.generate("r", [1, 2, 3], params):
                chunks.append(chunk)
                if sum(len(c.token_ids) for c in chunks) == 6:
                    await engine.pause("keep")
                    await engine.update_weights(_biased_weights(engine, token=9).items(), version=5)
                    await engine.resume()

        await consume()
        await engine.shutdown()
        return chunks

    chunks = asyncio.run(run())
    tokens = [t for c in chunks for t in c.token_ids]
    versions = [v for c in chunks for v in c.versions]
    assert len(tokens) == 25 and chunks[-1].finish_reason == "length"
    # The engine may run a step ahead of the consumer, so the switch is at or after token 6.
    switch = versions.index(5)
    assert 6 <= switch < 20
    assert versions[:switch] == [0] * switch and versions[switch:] == [5] * (25 - switch)
    assert tokens[switch:] == [9] * (25 - switch)  # the new weights produced every later token
    # Recompute: the request is re-prefilled under the new weights; keep: decoding just goes on.
    assert engine.stats.prefills == (2 if recompute else 1)


def test_pause_abort_mode_finishes_in_flight(engine):
    async def run():
        params = SamplingParams(max_new_tokens=25)
        chunks = []
        async for chunk in engine.generate("r", [1, 2, 3], params):
            chunks.append(chunk)
            if len(chunks) == 2:
                await engine.pause("abort")
        await engine.shutdown()
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks) < 25


def test_non_streaming_requests_get_one_final_chunk(engine):
    async def run():
        chunks = []
        async for chunk in engine.generate("q", [1, 2, 3], SamplingParams(max_new_tokens=9, stream=False)):
            chunks.append(chunk)
        await engine.shutdown()
        return chunks

    chunks = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].finish_reason == "length"
    assert len(chunks[0].token_ids) == len(chunks[0].logprobs) == len(chunks[0].versions) == 9


def _stop_mixed_batch(engine, stream: bool = True):
    """16 requests: 8 with a budget of 3 tokens (they end by length, or by a stop, within 3 steps,
    so the batch compacts then), 8 with 30 tokens that stop tokens 3 and 5 end at scattered steps.
    ``stream``: a chunk per step (recorded step by step) or one at the end (a burst's tokens
    recorded per row at once)."""
    from megatron_rl.data.datasets import Prompt
    from megatron_rl.rollout.workflow import single_turn

    async def run():
        jobs = []
        for i in range(16):
            params = SamplingParams(max_new_tokens=3 if i % 2 else 30, stop_token_ids=(3, 5), stream=stream)
            jobs.append(single_turn(engine, Prompt(f"r{i}", "", [1 + i % 7, 2 + i % 5, 9], ""), 0, params, f"r{i}"))
        return list(await asyncio.gather(*jobs))

    return asyncio.run(run())


def _run_in_bursts(monkeypatch, weights: dict, burst: int, max_batch_size: int, stream: bool = True):
    """``_stop_mixed_batch`` on an engine of ``max_batch_size`` rows decoding up to ``burst`` steps
    per hand-off: (trajectories, stats, [(requests waiting, steps) per hand-off])."""
    import megatron_rl.rollout.embedded.engine as engine_module

    monkeypatch.setattr(engine_module, "DECODE_BURST", burst)
    engine = EmbeddedEngine(ModelConfig(), VOCAB, max_batch_size=max_batch_size, seed=0)
    # The same weights for every run (on a GPU, Megatron's initialisation RNG moves on per model).
    weights.setdefault("state", engine.model.state_dict())
    engine.model.load_state_dict(weights["state"])
    handoffs = []
    real = engine._decode_burst

    def counted(*args):
        steps = real(*args)
        handoffs.append((bool(engine._pending), len(steps)))
        return steps

    engine._decode_burst = counted
    return _stop_mixed_batch(engine, stream), engine.stats, handoffs


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_decode_bursts_sample_what_single_steps_sample(megatron_world, monkeypatch, stream):
    """The compute thread decodes several steps per hand-off; it must stop exactly where the
    one-step loop would compact finished rows, or the rows (and the draws) would differ. Whole
    responses have a burst's tokens recorded per row at once, cut at a stop or the budget as
    one step at a time cuts them."""
    weights = {}
    single, single_stats, single_handoffs = _run_in_bursts(monkeypatch, weights, 1, 16, stream)
    burst, burst_stats, burst_handoffs = _run_in_bursts(monkeypatch, weights, 16, 16, stream)
    assert [t.response_ids for t in burst] == [t.response_ids for t in single]
    assert [t.logprobs for t in burst] == [t.logprobs for t in single]
    assert [t.finish_reason for t in burst] == [t.finish_reason for t in single]
    assert {t.finish_reason for t in single} == {"length", "stop"}
    assert burst_stats.tokens == single_stats.tokens
    assert single_stats.admit_s > 0 and burst_stats.admit_s > 0  # the batch was compacted (no newcomers)
    assert burst_stats.decode_steps == single_stats.decode_steps == len(single_handoffs)
    assert burst_stats.decode_rows == single_stats.decode_rows
    assert len(burst_handoffs) < len(single_handoffs) / 2


def test_a_full_batch_with_requests_waiting_decodes_in_bursts_until_a_row_finishes(megatron_world, monkeypatch):
    """16 requests, 6 rows: ten wait while the batch is full. Nothing can join until a row
    finishes, so the compute thread decodes until then instead of handing off after every step;
    it must still hand off exactly where the one-step loop admits, or the draws would differ."""
    weights = {}
    single, single_stats, single_handoffs = _run_in_bursts(monkeypatch, weights, 1, 6)
    burst, burst_stats, burst_handoffs = _run_in_bursts(monkeypatch, weights, 16, 6)
    assert [t.response_ids for t in burst] == [t.response_ids for t in single]
    assert [t.logprobs for t in burst] == [t.logprobs for t in single]
    assert burst_stats.decode_steps == single_stats.decode_steps
    assert burst_stats.decode_rows == single_stats.decode_rows
    assert burst_stats.admissions == single_stats.admissions > 0
    waiting = [steps for pending, steps in burst_handoffs if pending]
    assert max(waiting) > 1 and len(waiting) < sum(pending for pending, _ in single_handoffs)


def test_a_group_samples_what_separate_requests_sample_and_cancels_or_fails_whole(megatron_world):
    """generate_n answers a group with one future (no stream per request). Its responses must be
    what the same requests made one by one get (same seed and weights: same rows, same draws);
    cancelling the group aborts its requests; a failed step fails the group with the error."""
    from megatron_rl.api.engine import RolloutEngine

    params = SamplingParams(max_new_tokens=12, stop_token_ids=(3, 5), stream=False)
    ids = [f"g{i}" for i in range(5)]
    weights = {}

    def build():
        engine = EmbeddedEngine(ModelConfig(), VOCAB, max_batch_size=8, seed=0)
        weights.setdefault("state", engine.model.state_dict())
        engine.model.load_state_dict(weights["state"])
        return engine

    async def grouped(per_request: bool):
        engine = build()
        generate_n = RolloutEngine.generate_n.__get__(engine) if per_request else engine.generate_n
        out = await generate_n(ids, [1, 4, 2], params)
        await engine.shutdown()
        return out

    async def cancelled_and_failed():
        engine = build()
        slow = SamplingParams(max_new_tokens=60, stream=False)
        group = engine.generate_n(["c0", "c1"], [1, 2], slow)
        requests = list(engine._pending)
        while not any(r.tokens for r in requests):  # running
            await asyncio.sleep(0.001)
        group.cancel()
        while engine._running or engine._pending:
            await asyncio.sleep(0.001)
        finishes = [r.finish for r in requests]
        engine._gen.decode_start = lambda *a: (_ for _ in ()).throw(RuntimeError("kernel fault"))
        with pytest.raises(EngineError, match="kernel fault"):
            await engine.generate_n(["f0", "f1"], [1, 2], slow)
        await engine.shutdown()
        return finishes

    separate = asyncio.run(grouped(per_request=True))
    whole = asyncio.run(grouped(per_request=False))
    assert [r.request_id for r in whole] == ids
    assert [r.token_ids.tolist() for r in whole] == [list(r.token_ids) for r in separate]
    assert [r.logprobs.tolist() for r in whole] == [list(r.logprobs) for r in separate]
    assert [r.finish_reason for r in whole] == [r.finish_reason for r in separate]
    assert len({tuple(r.token_ids) for r in whole}) > 1  # sampled, not one answer copied
    assert all(len(r.token_ids) == len(r.logprobs) == len(r.versions) for r in whole)
    assert asyncio.run(asyncio.wait_for(cancelled_and_failed(), timeout=60)) == ["abort", "abort"]


def test_engine_rows_hold_what_rollouts_need_not_the_checkpoints_whole_context(megatron_world):
    """A checkpoint's max_position_embeddings (40,960 for Qwen3) does not size the KV cache: rows
    hold data.max_prompt_tokens + rollout.max_new_tokens, agents the model's context, and
    rollout.max_model_len when set."""
    from megatron_rl.checks import load_config
    from megatron_rl.rollout.embedded.engine import engine_context_tokens, engine_options

    cfg = load_config("tiny_cpu", ["model.max_position_embeddings=4096", "data.max_prompt_tokens=40",
                                   "rollout.max_new_tokens=24"])
    assert engine_options(cfg)["max_seq_len"] == 64
    engine = EmbeddedEngine(cfg.model, VOCAB, max_batch_size=2, seed=0, **engine_options(cfg))
    try:
        assert engine._gen.max_seq_len == 64
        with pytest.raises(ValueError, match="the 64 tokens an engine row holds"):
            engine._gen.check_request(50, 24)
    finally:
        asyncio.run(engine.shutdown())
    assert engine_context_tokens(load_config("tiny_cpu", ["model.max_position_embeddings=4096",
                                                          "rollout.max_model_len=1000"])) == 1000
    assert engine_context_tokens(load_config("tiny_cpu", ["model.max_position_embeddings=4096",
                                                          "rollout.workflow=calculator_agent"])) == 4096


def test_long_tail_lengths_are_honoured_and_stop_tokens_ignored_until_then(megatron_world):
    """A model that always emits the stop token still answers each request with exactly its
    drawn length (rollout/long_tail.py), capped at max_new_tokens; without the workload it stops at
    once."""
    from megatron_rl.rollout.long_tail import LongTailLengths

    long_tail = LongTailLengths(median=6, p99=40, seed=2)
    torch.manual_seed(0)
    engine = EmbeddedEngine(ModelConfig(), VOCAB, max_batch_size=8, seed=0, long_tail=long_tail)
    ids = [f"r{i}" for i in range(12)]
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(3,), stream=False)

    async def run(e):
        await e.pause()
        await e.update_weights(_biased_weights(e, token=3).items(), version=1)
        await e.resume()
        out = await e.generate_n(ids, [1, 2, 5], params)
        await e.shutdown()
        return out

    drawn = [long_tail.draw(rid, 30) for rid in ids]
    assert len(set(drawn)) > 4 and max(drawn) <= 30
    responses = asyncio.run(run(engine))
    assert [len(r.token_ids) for r in responses] == drawn
    assert all(set(r.token_ids.tolist()) == {3} for r in responses)
    assert [r.finish_reason for r in responses] == ["length"] * len(ids)
    torch.manual_seed(0)
    plain = asyncio.run(run(EmbeddedEngine(ModelConfig(), VOCAB, max_batch_size=8, seed=0)))
    assert [len(r.token_ids) for r in plain] == [1] * len(ids)


@pytest.mark.parametrize("tokens,stops,remaining,expected", [
    ([5, 2, 7], (7,), 10, (3, "stop")),  # the stop token is kept
    ([5, 2, 7], (2, 7), 10, (2, "stop")),  # the first stop ends it
    ([5, 2, 7], (9,), 2, (2, "length")),  # the budget cuts the burst
    ([5, 2, 7], (9,), 3, (3, "length")),  # ... exactly at its end
    ([5, 2, 7], (9,), 4, (3, None)),  # it goes on
    ([5, 2, 7], (), 2, (2, "length")),  # no stop tokens (a forced length)
    ([5], (5,), 1, (1, "stop")),  # a stop on the last budgeted token is a stop
    ([5], (6,), 1, (1, "length")),
    ([5], (6,), 0, (1, "length")),  # an exhausted budget still records the token it has
])
def test_the_finish_rule(tokens, stops, remaining, expected):
    """One rule decides where a row's tokens end, for a step's token and for a burst's: the
    recording of each and the compute thread's look-ahead all call it."""
    from megatron_rl.rollout.embedded.engine import cut_at_finish

    assert cut_at_finish(tokens, stops, remaining) == expected
