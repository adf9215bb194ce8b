"""No decode bucket is captured during a run: the engine captures every bucket it can reach before
its first step, so admission into a running decode (which grows the batch into a larger row
bucket) never captures one. CI has no GPU: the static step runs eagerly here, and the same bucket
registry that decides what a GPU captures counts its captures (decode_graphs.py)."""

import asyncio

import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.embedded import decode_graphs
from megatron_rl.types import SamplingParams


def _admit_into_running_decode(engine: EmbeddedEngine):
    """4 requests start decoding; once they have run a few steps, 12 more join the running batch
    (8 rows' bucket -> 16 rows'); every response runs to its length across several widths."""
    params = SamplingParams(max_new_tokens=40, stream=False)

    async def run():
        first = engine.generate_n([f"a{i}" for i in range(4)], [1, 2, 3], params)
        while engine.stats.decode_steps < 3:
            await asyncio.sleep(0.005)
        later = engine.generate_n([f"b{i}" for i in range(12)], [4, 5], params)
        done = await asyncio.gather(first, later)
        await engine.shutdown()
        return [r for group in done for r in group]

    return asyncio.run(run())


def test_admission_into_a_running_decode_does_not_capture(megatron_world, monkeypatch):
    monkeypatch.setattr(decode_graphs, "WIDTH_STEP", 8)  # a 128-slot cache: 16 widths
    torch.manual_seed(0)
    engine = EmbeddedEngine(ModelConfig(), 32, max_batch_size=16, max_seq_len=64, static_decode=True)
    responses = _admit_into_running_decode(engine)
    assert all(len(r.token_ids) == 40 for r in responses)
    stats = engine.stats
    assert stats.admissions >= 1 and stats.decode_steps > 40
    reachable = decode_graphs.reachable_buckets(16, 128)
    assert len(reachable) == 16 * 2
    assert set(engine._gen._static.graphs) == set(reachable)
    assert stats.captures == len(reachable) and stats.late_captures == 0


def test_the_counter_sees_captures_during_a_run(megatron_world, monkeypatch):
    """Without the start-up capture every bucket is captured on first use, during the run: the
    counter the test above reads would show it."""
    monkeypatch.setattr(decode_graphs, "WIDTH_STEP", 8)
    monkeypatch.setattr(decode_graphs.StaticDecoder, "capture_all",
                        lambda self: setattr(self, "_started", True))
    torch.manual_seed(0)
    engine = EmbeddedEngine(ModelConfig(), 32, max_batch_size=16, max_seq_len=64, static_decode=True)
    _admit_into_running_decode(engine)
    used = set(engine._gen._static.graphs)
    assert {rows for rows, _ in used} == {8, 16}  # the admission grew the batch's bucket
    assert engine.stats.late_captures == engine.stats.captures == len(used) > 1
