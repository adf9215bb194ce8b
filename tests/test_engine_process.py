"""The embedded engine in a child process: same results as in-process, weights travel, and a
dead engine process fails its requests (and the run) with a clear error instead of hanging."""

import asyncio
import os
import signal

import pytest
import torch

from megatron_rl.config.schema import RootConfig
from megatron_rl.learner.learner import Learner
from megatron_rl.rollout.embedded import EngineProcess
from megatron_rl.api.engine import EngineError
from megatron_rl.types import SamplingParams

from engine_helpers import generate_all, kill_engine_after_step

VOCAB = 48


def _cfg() -> RootConfig:
    cfg = RootConfig()
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 64, 128
    return cfg


def test_child_process_engine_logprobs_equal_the_learners(megatron_world):
    """Weights sent to the child arrive intact: its sampled tokens carry the learner's logprobs
    and the version they were sent as."""
    cfg = _cfg()
    learner = Learner(cfg, VOCAB)
    prompts = [[(3 * i + j) % 40 + 1 for j in range(2 + i)] for i in range(8)]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(7,), stream=False)

    async def run():
        engine = EngineProcess(cfg.model, VOCAB, seed=11)
        # pause, load and resume go down the pipe together (one round trip)
        await engine.swap_weights(learner.export_hf_weights(), version=3)
        trajs = await generate_all(engine, prompts, params)
        # ... also in the middle of requests, which continue on the new version
        long = SamplingParams(max_new_tokens=40)  # streamed: the engine's counters come back per step
        first = engine.stats.decode_steps
        running = asyncio.ensure_future(generate_all(engine, prompts, long, tag="late"))
        while engine.stats.decode_steps < first + 2:
            await asyncio.sleep(0.005)
        await engine.swap_weights(learner.export_hf_weights(), version=4)
        late = await running
        await engine.shutdown()
        return trajs, late, engine.stats

    trajs, late, stats = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert all(t.versions == [3] * len(t.response_ids) and t.response_ids for t in trajs)
    assert all(len(t.response_ids) == 40 and t.versions == sorted(t.versions) for t in late)
    assert {v for t in late for v in t.versions} == {3, 4}
    assert stats.tokens == sum(len(t.response_ids) for t in trajs + late)  # counters come back too
    ours = learner.compute_logprobs(trajs, 1.0)
    gap = max(abs(a - b) for t, row in zip(trajs, ours) for a, b in zip(t.logprobs, row))
    assert gap <= 1e-5, gap


def test_killed_engine_process_fails_requests_with_a_clear_error(megatron_world):
    cfg = _cfg()

    async def run():
        engine = EngineProcess(cfg.model, VOCAB, seed=1)
        params = SamplingParams(max_new_tokens=40)
        stream = engine.generate("r0", [1, 2, 3], params)
        first = await stream.__anext__()  # the child is serving
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="engine process exited"):
            async for _ in stream:
                pass
        with pytest.raises(EngineError, match="engine process exited"):
            await engine.pause()
        assert engine.failure
        await engine.shutdown()
        return first

    first = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert first.token_ids


def test_a_group_comes_back_whole_in_one_message_and_aborts_or_fails_cleanly(megatron_world):
    """generate_n: every response of the group, whole and in request order, tagged with the
    version; aborting some of its requests finishes those with "abort"; a killed child fails the
    group with a clear error instead of leaving it waiting."""
    cfg = _cfg()

    async def run():
        engine = EngineProcess(cfg.model, VOCAB, seed=2)
        await engine.pause()
        await engine.update_weights(Learner(cfg, VOCAB).export_hf_weights(), version=5)
        await engine.resume()
        ids = [f"g-{i}" for i in range(4)]
        whole = await engine.generate_n(ids, [1, 2, 3], SamplingParams(max_new_tokens=12, stream=False))
        long = SamplingParams(max_new_tokens=50, stream=False)
        group = asyncio.ensure_future(engine.generate_n(["a-0", "a-1", "a-2"], [4, 5], long))
        await engine.abort(["a-0", "a-2"])
        aborted = await group
        doomed = asyncio.ensure_future(engine.generate_n(["k-0", "k-1"], [6, 7], long))
        await asyncio.sleep(0)  # posted, maybe not yet answered: either way it must fail
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="engine process exited"):
            await doomed
        await engine.shutdown()
        return ids, whole, aborted

    ids, whole, aborted = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert [r.request_id for r in whole] == ids
    assert all(len(r.token_ids) == len(r.logprobs) == 12 and r.versions.tolist() == [5] * 12 for r in whole)
    assert all(r.finish_reason == "length" for r in whole)
    assert [r.finish_reason for r in aborted] == ["abort", "length", "abort"]


def test_run_stops_with_a_clear_error_when_the_engine_process_dies(megatron_world, tmp_path):
    """Killing the engine process mid-run ends the run with RolloutsStopped (no hang, no endless
    retries), and the ledger still accounts for every admitted prompt."""
    from megatron_rl.checks import load_config
    from megatron_rl.scheduler.controller import RolloutsStopped
    from megatron_rl.build import build_trainer

    cfg = load_config("tiny_cpu", [
        "trainer.total_steps=50", f"trainer.run_dir={tmp_path}", "trainer.progress=false",
        "trainer.save_final_checkpoint=false", "scheduler.max_staleness=1", "rollout.separate_process=true",
        "algo.groups_per_batch=4", "algo.group_size=4"])
    trainer = build_trainer(cfg)
    kill_engine_after_step(trainer, 3, lambda: [trainer.engine._proc.pid])
    with pytest.raises(RolloutsStopped, match="engine process exited"):
        trainer.run()
    assert trainer.ledger.balanced()
    assert trainer.ledger.counts["returned_stopped"] >= 1


def test_later_weight_updates_reuse_the_shared_buffers_and_arrive_whole(megatron_world):
    """After the first update the child keeps the shared-memory buffers and later updates only
    rewrite them: each update's weights (not the previous ones) are what the child samples with."""
    cfg = _cfg()
    learner = Learner(cfg, VOCAB)
    prompts = [[(5 * i + j) % 40 + 1 for j in range(3 + i)] for i in range(6)]
    params = SamplingParams(max_new_tokens=8, stream=False)

    async def run():
        engine = EngineProcess(cfg.model, VOCAB, seed=3)
        rounds = []
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in learner.module.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            await engine.swap_weights(learner.export_hf_weights(), version)
            trajs = await generate_all(engine, prompts, params, tag=f"v{version}-")
            rounds.append((trajs, learner.compute_logprobs(trajs, 1.0), engine._shared_weights))
        await engine.shutdown()
        return rounds

    rounds = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert rounds[0][2] is not None and all(r[2] is rounds[0][2] for r in rounds)  # one set of buffers
    for version, (trajs, ours, _) in enumerate(rounds, start=1):
        assert all(t.versions == [version] * len(t.response_ids) for t in trajs)
        gap = max(abs(a - b) for t, row in zip(trajs, ours) for a, b in zip(t.logprobs, row))
        assert gap <= 1e-5, (version, gap)


def test_a_child_process_moe_engine_returns_routing(megatron_world):
    """A mixture of experts in a child process: its routing crosses the pipe, whole responses
    (a group, one message) and streamed chunks alike."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.api.engine import whole_response

    model = ModelConfig(family="qwen3_moe", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=48, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)

    async def run():
        engine = EngineProcess(model, VOCAB, seed=2)
        group = await engine.generate_n(["a", "b"], [1, 2, 3, 4], SamplingParams(max_new_tokens=6, stream=False))
        streamed = await whole_response(engine.generate("c", [5, 6], SamplingParams(max_new_tokens=5)))
        await engine.shutdown()
        return group + [streamed]

    on = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert [r.routed_experts.shape for r in on] == [(4 + 6 - 1, 2, 2)] * 2 + [(2 + 5 - 1, 2, 2)]
    assert all(r.routed_experts.dtype.name == "uint8" and r.routed_experts.max() < 4 for r in on)
