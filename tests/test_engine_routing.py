"""The embedded engine records each MoE layer's chosen experts for every position it computes
(routing replay): what it returns for a response equals, position by position and layer by
layer, the routing of one plain forward over prompt + response, and a position keeps the routing
of the weights that first computed it across a weight update."""

import asyncio

import numpy as np
import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.api.engine import whole_response
from megatron_rl.types import SamplingParams

VOCAB = 48
MOE = dict(family="qwen3_moe", num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=48, num_experts=6, moe_router_topk=2, moe_ffn_hidden_size=24)


def _randomize(model, seed: int, scale: float = 0.2) -> None:
    """Random weights (Megatron's near-zero init leaves router scores near ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if p.ndim == 1 else 0.0))


def _plain_routing(model_cfg: ModelConfig, state: dict, ids) -> np.ndarray:
    """[positions, moe layers, top_k] routing of one uncached causal forward over ``ids`` by a
    model (the learner's build, no KV cache) holding ``state``."""
    from megatron_rl.models.causal_attention import causal_mask
    from megatron_rl.models.gpt import build_gpt_model, model_device
    from megatron_rl.models.routing import record_routing, recorded_choices

    model = build_gpt_model(model_cfg, VOCAB).eval()
    model.load_state_dict(state)
    record_routing(model)
    device = model_device()
    tokens = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device).unsqueeze(0)
    with torch.no_grad():
        model(tokens, positions, causal_mask(len(ids), device), runtime_gather_output=True)
    return recorded_choices(model).transpose(0, 1).cpu().numpy()


def _hf(cfg: ModelConfig, state: dict):
    """A Megatron state dict under Hugging Face names (what a weight update sends)."""
    from megatron_rl.models.hf_names import is_weight, megatron_to_hf

    return [pair for name, t in state.items() if isinstance(t, torch.Tensor) and is_weight(name, cfg)
            for pair in megatron_to_hf(name, t, cfg)]


def _engine(static_decode: bool, **kw):
    """An engine on the tiny MoE model with random weights; ``static_decode``: its decode steps
    through the static-shape decoder (what CUDA graphs replay on a GPU), run eagerly."""
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator

    cfg = ModelConfig(**MOE)
    engine = EmbeddedEngine(cfg, VOCAB, seed=4, **kw)
    _randomize(engine.model, seed=1)
    if static_decode:
        old = engine._gen
        engine._gen = KVCachedGenerator(engine.model, old.max_batch_size, old.max_seq_len, engine.device, seed=4,
                                        static_decode=True)
        assert engine._gen._static is not None
    assert engine._gen.records_routing
    return cfg, engine


@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "static"])
def test_recorded_routing_equals_a_plain_forward(megatron_world, monkeypatch, static_decode):
    """Prompts of different lengths in one left-padded batch, a group sharing one prompt
    (prefilled once, its routing copied), streamed and whole responses, newcomers admitted into
    the running batch (in length groups), finished rows compacted away: every response's routing
    is that of positions 0 .. len(prompt) + len(response) - 2, equal to a plain forward's."""
    from megatron_rl.rollout.embedded import decode_graphs
    from megatron_rl.rollout.embedded import engine as engine_module

    monkeypatch.setattr(decode_graphs, "WIDTH_STEP", 8)
    monkeypatch.setattr(engine_module, "DECODE_BURST", 1)  # the event loop sees every step
    cfg, engine = _engine(static_decode, max_batch_size=12)
    params = SamplingParams(max_new_tokens=14)

    async def run():
        lead = asyncio.create_task(whole_response(engine.generate("lead", [1, 2, 3], SamplingParams(max_new_tokens=40))))
        group = engine.generate_n(["g0", "g1", "g2"], [5, 6, 7, 8, 9, 10, 11], params)
        short = asyncio.create_task(whole_response(engine.generate("s", [12, 13], SamplingParams(max_new_tokens=6))))
        while engine.stats.decode_steps < 11:  # the first batch is decoding at offset 18, "s" done
            await asyncio.sleep(0.001)
        # Newcomers join in place, in two length groups (4 and 17 tokens), a duplicate pair among them.
        later = engine.generate_n(["l0", "l1"], [20, 21, 22, 23], params)
        longer = asyncio.create_task(whole_response(engine.generate("x", list(range(24, 41)), params)))
        responses = [await lead, *(await group), await short, *(await later), await longer]
        await engine.shutdown()
        return responses

    responses = asyncio.run(run())
    assert engine.stats.prefills == 1 and engine.stats.admissions == 1, engine.stats
    prompts = [[1, 2, 3]] + [[5, 6, 7, 8, 9, 10, 11]] * 3 + [[12, 13]] + [[20, 21, 22, 23]] * 2 + [list(range(24, 41))]
    state = engine.model.state_dict()
    for prompt, response in zip(prompts, responses):
        routing = response.routed_experts
        ids = prompt + list(response.token_ids)  # a stream's list or a group's array
        assert routing.dtype == np.uint8 and routing.shape == (len(ids) - 1, 3, 2), (response.request_id, routing.shape)
        expected = _plain_routing(cfg, state, ids)[: len(ids) - 1]
        mismatched = np.argwhere((routing != expected).any(-1))
        assert not len(mismatched), (response.request_id, mismatched[:5])
    assert len({tuple(r.token_ids) for r in responses[1:4]}) > 1  # the group's rows sampled apart


def test_a_position_keeps_the_routing_of_the_weights_that_first_computed_it(megatron_world):
    """A response spans a weight update (pause, new weights, resume; the engine re-prefills the
    row under the new weights): positions computed before keep the old weights' routing, which
    the re-prefill computed again differently, and those after have the new weights'."""
    from megatron_rl.models.gpt import build_gpt_model

    cfg, engine = _engine(static_decode=False, recompute_kv_on_update=True)
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if isinstance(v, torch.Tensor)}
    other = build_gpt_model(cfg, VOCAB)
    _randomize(other, seed=2, scale=0.3)
    v1 = other.state_dict()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    async def run():
        chunks = []
        async for chunk in engine.generate("r", prompt, SamplingParams(max_new_tokens=30)):
            chunks.append(chunk)
            if sum(len(c.token_ids) for c in chunks) >= 6 and engine.weight_version() == 0:
                await engine.pause()
                await engine.update_weights(_hf(cfg, v1), version=1)
                await engine.resume()
        await engine.shutdown()
        return chunks

    chunks = asyncio.run(run())
    versions = [v for c in chunks for v in c.versions]
    tokens = [t for c in chunks for t in c.token_ids]
    assert 0 in versions and 1 in versions and engine.stats.prefills == 2, (versions, engine.stats)
    routing = np.concatenate([c.routed_experts for c in chunks if c.routed_experts is not None])
    ids = prompt + tokens
    assert routing.shape[0] == len(ids) - 1
    # Position p was computed by the step that sampled response token max(0, p - len(prompt) + 1).
    computed_by = np.array([versions[max(0, p - len(prompt) + 1)] for p in range(len(ids) - 1)])
    old, new = _plain_routing(cfg, v0, ids)[: len(ids) - 1], _plain_routing(cfg, v1, ids)[: len(ids) - 1]
    np.testing.assert_array_equal(routing[computed_by == 0], old[computed_by == 0])
    np.testing.assert_array_equal(routing[computed_by == 1], new[computed_by == 1])
    # The re-prefill under v1 routed some of the old positions elsewhere: their record did not follow.
    assert (old[computed_by == 0] != new[computed_by == 0]).any()


def test_routing_is_not_recorded_when_switched_off_or_dense(megatron_world):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    async def run(engine):
        response = await whole_response(engine.generate("r", [1, 2, 3], SamplingParams(max_new_tokens=4)))
        await engine.shutdown()
        return response

    off = EmbeddedEngine(ModelConfig(**MOE), VOCAB, record_routing=False)
    dense = EmbeddedEngine(ModelConfig(), VOCAB)
    assert not off._gen.records_routing and not dense._gen.records_routing
    for engine in (off, dense):
        response = asyncio.run(run(engine))
        assert len(response.token_ids) == 4 and response.routed_experts is None


@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "static"])
def test_routing_of_a_row_decoded_across_window_slides(megatron_world, monkeypatch, static_decode):
    """A row that joins late and decodes while the cache window slides left under it (its
    entries moved, keys rotated back): its routing, from admission and each decode step, is
    still a plain forward's."""
    from megatron_rl.models.gpt import build_gpt_model, model_device
    from megatron_rl.rollout.embedded import decode_graphs
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator

    monkeypatch.setattr(decode_graphs, "WIDTH_STEP", 8)
    cfg = ModelConfig(**MOE)
    model = build_gpt_model(cfg, VOCAB, kv_attention=True).eval()
    _randomize(model, seed=1)
    gen = KVCachedGenerator(model, max_batch_size=12, max_seq_len=64, device=model_device(), seed=0,
                            static_decode=static_decode)
    params = SamplingParams(max_new_tokens=60)
    gen.prefill([[1, 2, 3, 4]] * 10, params)
    for _ in range(30):
        gen.decode(params)
    prompt = [5, 6, 7, 8, 9]
    joined = gen.admit([], [prompt], params)  # the early rows leave; this one joins at slot 29
    tokens, routing = list(joined[0]), [joined.routing[0]]
    for _ in range(24):
        step = gen.decode(params)
        tokens.append(step[0][0])
        routing.append(step.routing[0])
    assert gen.slides >= 1
    routing = np.concatenate(routing)
    ids = prompt + tokens
    assert routing.shape == (len(ids) - 1, 3, 2)
    np.testing.assert_array_equal(routing, _plain_routing(cfg, model.state_dict(), ids)[: len(ids) - 1])
