"""The embedded engine's sampling logprobs equal the learner's for the same weights and tokens."""

import asyncio

import pytest
import torch

from megatron_rl.config.schema import RootConfig
from megatron_rl.learner.learner import Learner
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.api.engine import whole_response
from megatron_rl.types import SamplingParams, Trajectory

from megatron_rl.data.datasets import Prompt
from megatron_rl.rollout.workflow import single_turn

from engine_helpers import generate_all
from hf_helpers import FAMILY_CONFIGS, hf_config


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


def _learner(perturb_seed: int = 0) -> Learner:
    """A small learner; ``perturb_seed`` > 0 moves every weight by noise (Megatron's own init is
    seeded by the parallel state, so two learners otherwise start equal)."""
    cfg = RootConfig()
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 64, 128
    learner = Learner(cfg, vocab_size=48)
    if perturb_seed:
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in learner.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device))
    return learner


def _gap(learner: Learner, trajs, keep) -> float:
    """Largest |engine - learner| logprob over the tokens for which ``keep(version)`` holds."""
    ours = learner.compute_logprobs(trajs, 1.0)
    gaps = [abs(e - o) for t, row in zip(trajs, ours)
            for e, o, v in zip(t.logprobs, row, t.versions) if keep(v)]
    assert gaps, "no tokens compared"
    return max(gaps)


def test_logprobs_agree_across_continuous_batching_and_a_weight_swap(megatron_world):
    """Requests join a running batch (the batch is re-prefilled with their prompts next to rows
    mid-response), and new weights arrive mid-request (rows re-prefilled under them): every token
    still carries exactly the logprob of the version it is tagged with."""
    old, new = _learner(), _learner(perturb_seed=1)

    async def run():
        engine = EmbeddedEngine(old.cfg.model, 48, max_batch_size=6, seed=5, recompute_kv_on_update=True)
        await engine.pause()
        await engine.update_weights(old.export_hf_weights(), version=1)
        await engine.resume()
        long = SamplingParams(max_new_tokens=55)
        short = SamplingParams(max_new_tokens=8, stop_token_ids=tuple(range(10, 48)))  # stops fast

        def submit(i, params, n):
            ids = [(5 * i + j) % 40 + 1 for j in range(n)]
            return asyncio.create_task(single_turn(engine, Prompt(f"p{i}", "", ids, ""), 0, params, f"r{i}"))

        later = []

        async def leading_row():
            ids = [1, 2, 3]
            tokens, logprobs, versions = [], [], []
            async for chunk in engine.generate("lead", ids, long):
                tokens += chunk.token_ids
                logprobs += chunk.logprobs
                versions += chunk.versions
                if len(tokens) >= 4 and not later:  # newcomers join the running batch
                    # Longest first: admitted in length groups, then put back in this order.
                    later.extend(submit(10 + i, short, 16 - 2 * i) for i in range(8))
                    # Swap once they are done (the engine keeps decoding this row meanwhile),
                    # so only the swap itself can rebuild the batch.
                    await asyncio.gather(*later)
                    await engine.pause("keep")
                    await engine.update_weights(new.export_hf_weights(), version=2)
                    await engine.resume()
            return Trajectory("lead", 0, ids, tokens, logprobs, versions, chunk.finish_reason)

        # A short row first: when it finishes, the long rows behind it move up (cache rows copied).
        first = [submit(2, short, 5), asyncio.create_task(leading_row()), submit(1, long, 4)]
        await first[1]
        trajs = await asyncio.gather(*first, *later)
        await engine.shutdown()
        return list(trajs), engine.stats

    trajs, stats = asyncio.run(run())
    # First batch and the re-prefill after the swap are rebuilds; newcomers joined in place.
    assert stats.prefills >= 2 and stats.admissions >= 1, stats
    assert all(t.finish_reason in ("stop", "length") for t in trajs)
    swapped = [t for t in trajs[1:3] if 1 in t.versions and 2 in t.versions]
    assert swapped, [t.versions for t in trajs[1:3]]  # a long row spans the weight swap
    assert all(t.versions == sorted(t.versions) for t in trajs)
    gap_old, gap_new = _gap(old, trajs, lambda v: v == 1), _gap(new, trajs, lambda v: v == 2)
    print(f"continuous batching: {stats}, gap v1 {gap_old:.2e}, gap v2 {gap_new:.2e}")
    assert gap_old <= 1e-5 and gap_new <= 1e-5, (gap_old, gap_new)


@pytest.mark.parametrize("attention", ["kv_attention", "megatron"])
def test_logprobs_agree_after_the_window_slides(megatron_world, attention):
    """A row that joined late, decoded long after the rows before it left: the cache window slides
    left (the shared offset shrinks) and its logprobs still equal the learner's. With the engine's
    attention the moved keys are stored rotated and must be rotated back; with Megatron's (kept
    for multi-latent attention) they are stored unrotated."""
    from megatron_rl.models.gpt import build_gpt_model, model_device
    from megatron_rl.models.kv_attention import EngineSelfAttention
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator

    learner = _learner()
    model = learner.module.eval()
    if attention == "kv_attention":
        engine_model = build_gpt_model(learner.cfg.model, 48, kv_attention=True).eval()
        engine_model.load_state_dict(model.state_dict())
        assert any(isinstance(m, EngineSelfAttention) for m in engine_model.modules())
        model = engine_model
    gen = KVCachedGenerator(model, max_batch_size=12, max_seq_len=64, device=model_device(), seed=0)
    params = SamplingParams(max_new_tokens=60)
    gen.prefill([[1, 2, 3, 4]] * 10, params)
    for _ in range(30):  # the early rows run; the offset reaches 34
        gen.decode(params)
    prompt = [5, 6, 7, 8, 9]
    tokens, logprobs = gen.admit([], [prompt], params)  # the early rows leave; B joins at slot 29
    offsets = []
    for _ in range(24):
        step_tokens, step_logprobs = gen.decode(params)
        tokens += step_tokens[:1]
        logprobs += step_logprobs[:1]
        offsets.append(gen.offset)
    assert gen.slides >= 1 and min(offsets) < 40, offsets  # without sliding it would end at 58
    traj = Trajectory("b", 0, prompt, tokens, logprobs, [0] * len(tokens), "length")
    gap = _gap(learner, [traj], lambda v: True)
    print(f"after {gen.slides} slide(s), offsets {offsets[0]}..{offsets[-1]}: gap {gap:.2e}")
    assert gap <= 1e-5, gap


def _decode_script(model, seed: int = 0):
    """Prefill rows of different lengths, decode, admit newcomers while compacting a finished row
    away, decode until the window slides; the sampled tokens and their logprobs, in order."""
    from megatron_rl.models.gpt import model_device
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator

    gen = KVCachedGenerator(model, max_batch_size=8, max_seq_len=64, device=model_device(), seed=seed)
    params = SamplingParams(max_new_tokens=60)
    out = [gen.prefill([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12]], params)]
    out += [gen.decode(params) for _ in range(6)]
    out.append(gen.admit([0, 2], [[13, 14, 15, 16], [17, 18]], params))
    out += [gen.decode(params) for _ in range(24)]
    last = len(out)
    out.append(gen.admit([], [LATE_PROMPT], params))  # the early rows leave; this one slides
    out += [gen.decode(params) for _ in range(24)]
    assert gen.slides >= 1 or getattr(model.config, "multi_latent_attention", False)
    tokens = [t for step_tokens, _ in out for t in step_tokens]
    logprobs = torch.tensor([lp for _, step_logprobs in out for lp in step_logprobs])
    late = [t for step_tokens, _ in out[last:] for t in step_tokens]
    late_logprobs = torch.tensor([lp for _, step_logprobs in out[last:] for lp in step_logprobs])
    return tokens, logprobs, late, late_logprobs


LATE_PROMPT = [19, 20, 21, 22, 23]


def _uncached_logprobs(model, prompt, response) -> torch.Tensor:
    """Logprobs of ``response`` after ``prompt`` from one plain causal forward (no cache)."""
    from megatron_rl.models.causal_attention import causal_mask
    from megatron_rl.models.gpt import model_device

    device = model_device()
    ids = torch.tensor([prompt + response], device=device)
    positions = torch.arange(ids.size(1), device=device).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids, positions, causal_mask(ids.size(1), device), runtime_gather_output=True)
    logprobs = torch.log_softmax(logits[0].float(), dim=-1)
    at = torch.arange(len(prompt) - 1, ids.size(1) - 1, device=device)
    return logprobs[at, ids[0, len(prompt):]].cpu()


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_engine_attention_equals_megatrons_for_every_family(megatron_world, family):
    """The engine's KV-cache attention (keys rotated when written, one fused call) samples what
    Megatron's own static-batching path samples, with the same logprobs, through prefill,
    admission, compaction and a window slide: GQA, q/k norms, biases, Llama-3 RoPE scaling, MoE
    layers; multi-latent attention (DeepSeek) keeps Megatron's path and must still agree. The row
    decoded across the window slide also equals an uncached forward (for DeepSeek, whose cached
    keys are rotated by Megatron and cannot move, the window does not slide: before, it did and
    that row's logprobs were off by up to 0.74)."""
    from megatron_rl.models.gpt import build_gpt_model
    from megatron_rl.models.hf_config import model_config_from_hf
    from megatron_rl.models.kv_attention import EngineSelfAttention

    from megatron_rl.models.families import get_family

    hf = {**hf_config(family).to_dict(), "architectures": [get_family(family).architecture]}
    cfg, vocab = model_config_from_hf(hf)
    megatron_path = build_gpt_model(cfg, vocab).eval()
    engine_path = build_gpt_model(cfg, vocab, kv_attention=True).eval()
    with torch.no_grad():  # random, not Megatron's near-zero init, so every weight matters
        gen = torch.Generator().manual_seed(1)
        for p in megatron_path.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    engine_path.load_state_dict(megatron_path.state_dict())
    uses_engine_attention = any(isinstance(m, EngineSelfAttention) for m in engine_path.modules())
    assert uses_engine_attention == (cfg.kv_lora_rank is None)
    tokens, logprobs, late, late_logprobs = _decode_script(megatron_path)
    engine_tokens, engine_logprobs, *_ = _decode_script(engine_path)
    assert engine_tokens == tokens
    gap = (engine_logprobs - logprobs).abs().max().item()
    # The row decoded across the window slide against one uncached forward of its sequence.
    slide_gap = (late_logprobs - _uncached_logprobs(megatron_path, LATE_PROMPT, late)).abs().max().item()
    print(f"{family}: {len(tokens)} tokens, max logprob gap {gap:.2e}; across the slide vs uncached {slide_gap:.2e}")
    assert gap <= 1e-4, gap
    assert slide_gap <= 1e-4, slide_gap


def test_a_groups_shared_prompt_is_prefilled_once(megatron_world):
    """A GRPO group's samples share one prompt: the engine prefills it once and copies its cache
    entries to the group's other rows, both when a batch is built and when a group joins a running
    batch. Each copy still samples on its own, and every logprob is the learner's."""
    learner = _learner()
    forwards = []  # rows of each multi-token (prefill) forward

    async def run():
        engine = EmbeddedEngine(learner.cfg.model, 48, max_batch_size=16, seed=9)
        model_logits = engine._gen._logits

        def counting(tokens, start, mask):
            if tokens.size(1) > 1:
                forwards.append(tokens.size(0))
            return model_logits(tokens, start, mask)

        engine._gen._logits = counting
        await engine.pause()
        await engine.update_weights(learner.export_hf_weights(), version=1)
        await engine.resume()
        params = SamplingParams(max_new_tokens=20)
        a, b, c, d = ([(3 * k + j) % 40 + 1 for j in range(n)] for k, n in enumerate((4, 6, 5, 9)))
        lead = asyncio.create_task(generate_all(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=40), "lead"))
        first = asyncio.create_task(generate_all(engine, [a] * 4 + [b] * 3, params, "first"))
        while engine.stats.decode_steps < 3:  # the first batch (lead, a, b) is decoding
            await asyncio.sleep(0.001)
        later = await generate_all(engine, [c] * 4 + [d] * 2, params, "later")  # joins in place
        trajs = (await lead) + (await first) + later
        await engine.shutdown()
        return trajs, engine.stats

    trajs, stats = asyncio.run(run())
    assert stats.prefills == 1 and stats.admissions >= 1, stats
    assert sum(forwards) == 5, forwards  # lead, a, b, then c and d: one row per distinct prompt
    responses_of_a = {tuple(t.response_ids) for t in trajs[1:5]}
    assert len(responses_of_a) > 1  # the copies sample independently
    gap = _gap(learner, trajs, lambda v: True)
    print(f"shared prompts: prefill forwards {forwards}, {stats}, gap {gap:.2e}")
    assert gap <= 1e-5, gap


@pytest.mark.parametrize("family, static", [("qwen2_moe", False), ("qwen3_moe", False), ("mixtral", False),
                                            ("deepseek_v3", False), ("deepseek_v3", True)],
                         ids=["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3-static"])
def test_engine_and_learner_logprobs_agree_for_moe(megatron_world, family, static):
    """Every mixture-of-experts family (Qwen2-MoE's gated shared expert, Qwen3-MoE's dense first
    layer, Mixtral, DeepSeek-V3's sigmoid group routing with multi-latent attention): the engine's
    logprobs (grouped experts routed on the device, routing recorded) equal the learner's for the
    same weights, and the engine returns the routing of every position it computed. ``static``:
    the engine decodes with the static-shape step a CUDA graph replays on a GPU (run eagerly
    here), for DeepSeek-V3 its multi-latent attention's own (models/mla.py)."""
    from megatron_rl.models.families import get_family
    from megatron_rl.models.hf_config import model_config_from_hf

    hf = {**hf_config(family).to_dict(), "architectures": [get_family(family).architecture]}
    cfg = RootConfig()
    cfg.model, vocab = model_config_from_hf(hf)
    learner = Learner(cfg, vocab_size=vocab)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # off Megatron's near-zero init, so routing is far from ties
        for p in learner.model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))

    static_steps = []

    async def run():
        engine = EmbeddedEngine(cfg.model, vocab, seed=3)
        if static:
            from megatron_rl.rollout.embedded.generator import KVCachedGenerator

            old = engine._gen
            engine._gen = KVCachedGenerator(engine.model, old.max_batch_size, old.max_seq_len, engine.device,
                                            seed=3, static_decode=True)
            decoder = engine._gen._static
            decoder.step = lambda *args, step=decoder.step: static_steps.append(1) or step(*args)
        await engine.pause()
        await engine.update_weights(learner.export_hf_weights(), version=1)
        await engine.resume()
        prompts = [[(7 * i + j) % 90 + 1 for j in range(2 + 3 * i)] for i in range(6)] + [[4, 5, 6]] * 2
        trajs = await generate_all(engine, prompts, SamplingParams(max_new_tokens=16))
        responses = [await whole_response(engine.generate("routed", prompts[1], SamplingParams(max_new_tokens=5)))]
        await engine.shutdown()
        return trajs, responses

    trajs, (routed,) = asyncio.run(run())
    assert bool(static_steps) == static
    assert sum(len(t.response_ids) for t in trajs) == 8 * 16
    assert routed.routed_experts.shape == (len(trajs[1].prompt_ids) + 5 - 1, num_moe_layers_of(cfg.model),
                                           cfg.model.moe_router_topk)
    gap = _gap(learner, trajs, lambda v: True)
    print(f"{family}: max |engine - learner| logprob gap {gap:.2e}")
    assert gap <= 1e-5, gap


def num_moe_layers_of(model_cfg) -> int:
    pattern = model_cfg.moe_layer_pattern
    return sum(pattern) if pattern is not None else model_cfg.num_layers
