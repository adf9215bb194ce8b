"""The embedded engine's sampling logprobs equal the learner's for the same weights and tokens."""

import asyncio

import pytest
import torch

from megatron_rl.config.schema import RootConfig
from megatron_rl.learner.learner import Learner
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.types import SamplingParams

from engine_helpers import generate_all


@pytest.mark.parametrize("family, temperature, top_k", [("llama", 1.0, 0), ("qwen2", 0.7, 5)])
def test_engine_and_learner_logprobs_agree(megatron_world, family, temperature, top_k):
    cfg = RootConfig()
    cfg.model.family = family
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 64, 128
    learner = Learner(cfg, vocab_size=48)

    async def run():
        engine = EmbeddedEngine(cfg.model, 48, seed=3)
        await engine.pause()
        await engine.update_weights(learner.export_hf_weights(), version=7)
        await engine.resume()
        # Prompt lengths 2..29 in one left-padded batch: up to 27 slots of padding shift.
        prompts = [[(7 * i + j) % 40 + 1 for j in range(2 + 3 * i)] for i in range(10)]
        params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=20)
        trajs = await generate_all(engine, prompts, params)
        await engine.shutdown()
        return trajs

    trajs = asyncio.run(run())
    assert all(t.versions == [7] * len(t.response_ids) for t in trajs)
    assert sum(len(t.response_ids) for t in trajs) == 200
    learner_lp = learner.compute_logprobs(trajs, temperature)
    engine_lp = torch.tensor([x for t in trajs for x in t.logprobs])
    ours = torch.tensor([x for row in learner_lp for x in row])
    gap = (engine_lp - ours).abs().max().item()
    print(f"max |engine - learner| logprob gap: {gap:.2e}")
    assert gap <= 1e-5, gap
