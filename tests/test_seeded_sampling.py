"""Per-request random streams: a seeded request's tokens depend on (seed, request id, position,
logits) only, whatever batch, row order or engine serves it."""

import asyncio
import threading
import dataclasses
from typing import Dict, List, Tuple

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.rollout import sampling
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.sampling import RowStreams, filter_logits, request_key, sample_tokens
from megatron_rl.rollout.vllm.engine import vllm_seed
from megatron_rl.types import SamplingParams

CPU = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 1.5])


def _streams(keys: List[int], positions: List[int]) -> RowStreams:
    return RowStreams.build(list(zip(keys, positions)), len(keys), CPU)


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> Tuple[float, int]:
    """Pearson's statistic of the token counts against ``probs`` and its degrees of freedom;
    a token of probability 0 must never be drawn."""
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    allowed = expected > 0
    assert observed[~allowed].sum() == 0, "a filtered-out token was drawn"
    stat = ((observed[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum().item()
    return stat, int(allowed.sum()) - 1


# Pearson statistic limits at p = 0.001 for df 1..5: a correct sampler stays below them.
CHI2_LIMIT = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5}


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.9, 4, 0.9)])
def test_keyed_draws_follow_the_filtered_distribution_over_keys_and_positions(temperature, top_k, top_p):
    n = 20000
    logits = LOGITS.repeat(n, 1)
    target = torch.softmax(filter_logits(LOGITS[None] / temperature, top_k, top_p), -1)[0]
    # Many requests at one position, and one request over many positions: both must be samples
    # of the target (a stream that ignored the position would repeat one token forever).
    over_keys = _streams([request_key(3, f"r{i}") for i in range(n)], [7] * n)
    over_positions = _streams([request_key(3, "one")] * n, list(range(n)))
    for streams in (over_keys, over_positions):
        tokens, logprobs = sample_tokens(logits, temperature, top_k, top_p, streams=streams)
        stat, df = _chi_square(tokens, target)
        assert stat < CHI2_LIMIT[df], (stat, df)
        # The logprob is the untruncated tempered one, as on the generator's path.
        assert torch.allclose(logprobs, torch.log_softmax(LOGITS / temperature, -1)[tokens])


def test_a_rows_draw_depends_on_its_key_position_and_logits_only(monkeypatch):
    torch.manual_seed(0)
    b, vocab = 64, 1000
    logits = torch.randn(b, vocab) * 3
    keys = [request_key(0, f"q{i}") for i in range(b)]
    positions = [i % 5 for i in range(b)]
    tokens, logprobs = sample_tokens(logits, 1.0, 50, 0.95, streams=_streams(keys, positions))
    again, _ = sample_tokens(logits, 1.0, 50, 0.95, streams=_streams(keys, positions))
    assert torch.equal(tokens, again)
    # Another order, a subset, or other rows beside it: each row draws the same token.
    perm = torch.randperm(b)
    shuffled, _ = sample_tokens(logits[perm], 1.0, 50, 0.95,
                                streams=_streams([keys[i] for i in perm], [positions[i] for i in perm]))
    assert torch.equal(shuffled, tokens[perm])
    alone, _ = sample_tokens(logits[5:6], 1.0, 50, 0.95, streams=_streams(keys[5:6], positions[5:6]))
    assert alone.item() == tokens[5].item()
    # Drawn in blocks of 5 rows (a big batch on a CPU): the same tokens.
    monkeypatch.setattr(sampling, "_CPU_BLOCK", 5 * vocab)
    blocked, _ = sample_tokens(logits, 1.0, 50, 0.95, streams=_streams(keys, positions))
    assert torch.equal(blocked, tokens)
    monkeypatch.undo()
    # Beside rows without a stream (drawn from the generator), keyed rows still draw the same.
    mixed = RowStreams.build([(k, p) if i % 2 else None for i, (k, p) in enumerate(zip(keys, positions))], b, CPU)
    mixed_tokens, mixed_logprobs = sample_tokens(logits, 1.0, 50, 0.95, torch.Generator().manual_seed(1), mixed)
    assert torch.equal(mixed_tokens[1::2], tokens[1::2])
    assert torch.allclose(mixed_logprobs, torch.log_softmax(logits, -1).gather(-1, mixed_tokens[:, None])[:, 0])
    # Another position or another request id: another draw (not the same token everywhere).
    later, _ = sample_tokens(logits, 1.0, 50, 0.95, streams=_streams(keys, [p + 1 for p in positions]))
    other, _ = sample_tokens(logits, 1.0, 50, 0.95,
                             streams=_streams([request_key(0, f"x{i}") for i in range(b)], positions))
    assert (later != tokens).sum() > b // 2 and (other != tokens).sum() > b // 2


def test_rows_without_a_stream_draw_from_the_generator_as_multinomial_does():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    expected = torch.multinomial(torch.softmax(filter_logits(logits / 0.8, 10, 0.9), -1), 1,
                                 generator=torch.Generator().manual_seed(5)).squeeze(-1)
    for streams in (None, RowStreams.none(16, CPU)):
        tokens, _ = sample_tokens(logits, 0.8, 10, 0.9, torch.Generator().manual_seed(5), streams)
        assert torch.equal(tokens, expected)


def test_vllm_gets_one_seed_per_request():
    seeds = {vllm_seed(7, f"g{i}") for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2 ** 63 for s in seeds)
    assert vllm_seed(7, "g0") == vllm_seed(7, "g0") != vllm_seed(8, "g0")
    assert vllm_seed(None, "g0") is None


# ---------------------------------------------------------------------------------------- engine
VOCAB = 32
SEEDED = SamplingParams(max_new_tokens=14, stop_token_ids=(3, 5), seed=11, stream=False)
UNSEEDED = dataclasses.replace(SEEDED, seed=None)
GROUP = ([f"g{i}" for i in range(4)], [1, 4, 2])
# Singles of several lengths; s6 shares the group's prompt (one prefill, copied rows).
SINGLES = [(f"s{i}", [1 + i, 2, 7] + [9] * (i % 3)) for i in range(6)] + [("s6", [1, 4, 2])]
Result = Dict[str, Tuple[List[int], List[float]]]


@pytest.fixture(scope="module")
def weights(megatron_world):
    torch.manual_seed(0)
    engine = EmbeddedEngine(ModelConfig(), VOCAB, max_batch_size=4)
    return {k: v.clone() for k, v in engine.model.state_dict().items() if isinstance(v, torch.Tensor)}


def _engine(weights, max_batch_size: int, seed: int = 0, recompute: bool = False) -> EmbeddedEngine:
    engine = EmbeddedEngine(ModelConfig(), VOCAB, max_batch_size=max_batch_size, seed=seed,
                            recompute_kv_on_update=recompute)
    engine.model.load_state_dict(weights, strict=False)
    return engine


async def _single(engine: EmbeddedEngine, rid: str, prompt: List[int], params: SamplingParams) -> Result:
    chunks = [c async for c in engine.generate(rid, prompt, params)]
    return {rid: ([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs])}


async def _group(engine: EmbeddedEngine, ids: List[str], prompt: List[int], params: SamplingParams) -> Result:
    # A group's whole responses hold numpy arrays; a stream's chunks lists.
    return {r.request_id: (r.token_ids.tolist(), r.logprobs.astype(float).tolist())
            for r in await engine.generate_n(ids, prompt, params)}


def _merge(parts) -> Result:
    out: Result = {}
    for part in parts:
        out.update(part)
    return out


def _assert_same(got: Result, want: Result) -> None:
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max((abs(a - b) for a, b in zip(got[rid][1], logprobs)), default=0.0) < 1e-6, rid


def _one_batch(weights) -> Result:
    async def run():
        engine = _engine(weights, max_batch_size=16)
        jobs = [_group(engine, *GROUP, SEEDED)] + [_single(engine, rid, p, SEEDED) for rid, p in SINGLES]
        out = _merge(await asyncio.gather(*jobs))
        await engine.shutdown()
        assert engine.stats.prefills == 1 and engine.stats.admissions == 0  # all rows in one batch
        return out

    return asyncio.run(run())


def test_seeded_requests_draw_the_same_whatever_batch_order_or_engine(weights):
    reference = _one_batch(weights)
    group = [tuple(reference[rid][0]) for rid in GROUP[0]]
    assert len(set(group)) == len(group)  # one prompt, distinct ids: distinct samples
    assert reference["s6"][0] not in [list(g) for g in group]
    assert len({len(t) for t, _ in reference.values()}) > 1  # stops at different steps: rows compact

    async def reordered_among_unseeded():
        # Small batches (requests wait and are admitted as rows finish), reversed order, unseeded
        # requests of the same sampler in the same batches, and another engine seed.
        engine = _engine(weights, max_batch_size=5, seed=9)
        jobs = []
        for i, (rid, prompt) in enumerate(reversed(SINGLES)):
            jobs.append(_single(engine, f"u{i}", prompt, UNSEEDED))
            jobs.append(_single(engine, rid, prompt, SEEDED))
        jobs.insert(3, _group(engine, *GROUP, SEEDED))
        out = _merge(await asyncio.gather(*jobs))
        await engine.shutdown()
        assert engine.stats.admissions > 0
        return out

    async def split_over_two_engines():
        first, second = _engine(weights, max_batch_size=8, seed=1), _engine(weights, max_batch_size=3, seed=2)
        jobs = [_group(first, *GROUP, SEEDED)]
        jobs += [_single(first if i % 2 else second, rid, p, SEEDED) for i, (rid, p) in enumerate(SINGLES)]
        out = _merge(await asyncio.gather(*jobs))
        await first.shutdown()
        await second.shutdown()
        return out

    mixed = asyncio.run(reordered_among_unseeded())
    _assert_same(mixed, reference)
    assert any(mixed[f"u{i}"][0] != mixed[rid][0] for i, (rid, _) in enumerate(reversed(SINGLES)))
    _assert_same(asyncio.run(split_over_two_engines()), reference)


@pytest.mark.parametrize("lookahead", [False, True], ids=["stepwise", "lookahead"])
@pytest.mark.parametrize("recompute", [True, False])
def test_seeded_requests_keep_their_streams_through_admission_and_weight_swaps(weights, recompute, lookahead):
    """Requests join while others are mid-flight; a pause and a swap to the same weights
    (re-prefilled with ``recompute_kv_on_update``) must continue each stream, not restart it.
    With the GPU's look-ahead (forced on here) a burst leaves a step in flight: the pause records
    it before the weights change, so no row loses or repeats a token."""
    reference = _one_batch(weights)
    long = dataclasses.replace(UNSEEDED, max_new_tokens=40, stop_token_ids=(), stream=True)

    async def run():
        engine = _engine(weights, max_batch_size=6, seed=4, recompute=recompute)
        engine.decode_lookahead = lookahead
        first = [_group(engine, *GROUP, SEEDED)]
        watcher = engine.generate("watch", [2, 2, 2], long)
        await watcher.__anext__()  # the first batch is decoding
        late = [_single(engine, rid, p, SEEDED) for rid, p in SINGLES]
        tasks = [asyncio.ensure_future(job) for job in first + late]
        while not any(r.tokens for r in engine._running.values() if r.request_id.startswith("s")):
            await asyncio.sleep(0.001)
        await engine.pause("keep")
        assert engine._inflight is None
        await engine.update_weights(_hf(engine, weights).items(), version=1)
        await engine.resume()
        out = _merge(await asyncio.gather(*tasks))
        async for _ in watcher:
            pass
        await engine.shutdown()
        assert engine.stats.admissions > 0
        assert engine.stats.prefills == (2 if recompute else 1)
        return out

    _assert_same(asyncio.run(run()), reference)


def _hf(engine: EmbeddedEngine, weights) -> Dict[str, torch.Tensor]:
    from megatron_rl.models.hf_names import megatron_to_hf

    hf = {}
    for name, tensor in weights.items():
        hf.update(megatron_to_hf(name, tensor.clone(), engine.model_cfg))
    return hf


def test_decode_lookahead_samples_what_the_step_by_step_loop_samples(weights):
    """On a GPU each decode step is launched before the previous one's tokens are read, and a burst
    that ends keeps the step already launched. Forced on here (a CPU computes at launch): seeded
    requests, admitted as rows finish in small batches, draw exactly the reference tokens, and
    every response ends where its stop token or budget says."""
    reference = _one_batch(weights)

    async def run():
        engine = _engine(weights, max_batch_size=5, seed=3)
        engine.decode_lookahead = True
        starts = []
        real = engine._gen.decode_start
        engine._gen.decode_start = lambda params: starts.append(1) or real(params)
        jobs = [_single(engine, rid, p, SEEDED) for rid, p in SINGLES] + [_group(engine, *GROUP, SEEDED)]
        out = _merge(await asyncio.gather(*jobs))
        await engine.shutdown()
        assert engine.stats.admissions > 0
        assert len(starts) == engine.stats.decode_steps  # every launched step was recorded
        return out

    got = asyncio.run(run())
    _assert_same(got, reference)
    for tokens, _ in got.values():
        assert len(tokens) <= SEEDED.max_new_tokens
        assert all(t not in SEEDED.stop_token_ids for t in tokens[:-1])


def test_a_pause_records_the_step_a_burst_left_in_flight(weights):
    """With the GPU's look-ahead (forced on here) a burst that ends on its budget leaves the step
    it launched running while the event loop records. A pause that comes then returns only once
    that step is recorded too (weights may change next, under its kernels on a GPU); the request
    then draws exactly the tokens of an uninterrupted run."""
    params = dataclasses.replace(SEEDED, max_new_tokens=48, stop_token_ids=(), stream=True)

    async def run(pause: bool):
        engine = _engine(weights, max_batch_size=4, seed=1)
        engine.decode_lookahead = True
        burst, left, gate = engine._decode_burst, threading.Event(), threading.Event()

        def held_burst(*args):  # the first burst that leaves a step in flight waits for the pause
            steps = burst(*args)
            if pause and engine._inflight is not None and not left.is_set():
                left.set()
                gate.wait(30)
            return steps

        engine._decode_burst = held_burst

        async def consume():
            return [t async for chunk in engine.generate("r", [1, 4, 2], params) for t in chunk.token_ids]

        task = asyncio.ensure_future(consume())
        if pause:
            assert await asyncio.to_thread(left.wait, 30)
            pausing = asyncio.ensure_future(engine.pause("keep"))
            await asyncio.sleep(0.01)  # the pause is waiting for the burst
            gate.set()
            await pausing
            assert engine._inflight is None
            await engine.update_weights(_hf(engine, weights).items(), version=1)
            await engine.resume()
        tokens = await task
        await engine.shutdown()
        return tokens

    uninterrupted = asyncio.run(run(False))
    assert len(uninterrupted) == 48
    assert asyncio.run(run(True)) == uninterrupted
