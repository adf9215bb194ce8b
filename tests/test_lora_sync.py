"""Adapter-only weight sync (lora.sync=adapters, weights/adapter_sync.py): the embedded engine
carries the learner's adapters and applies them unmerged; after the first sync (the frozen base
and the adapters) each sync sends the adapters alone, and the engine's logprobs stay the
learner's (fp32, <= 1e-5) through several of them."""

import asyncio
import copy
import json

import pytest
import torch

from megatron_rl.checks import load_config
from megatron_rl.learner.worker import LearnerWorker
from megatron_rl.models.lora import adapters_disabled, is_adapter_name
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.types import SamplingParams
from megatron_rl.weights.adapter_sync import AdapterTransport

from engine_helpers import generate_all
from parallel_cases import VOCAB, batch, tiny_cfg

TOL = 1e-5


def _lora_cfg():
    cfg = tiny_cfg()
    cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    return cfg


def _gap(learner, trajs) -> float:
    ours = learner.compute_logprobs(trajs, 1.0)
    return max(abs(e - o) for t, row in zip(trajs, ours) for e, o in zip(t.logprobs, row))


def test_engine_applies_adapters_unmerged_through_adapter_only_syncs(megatron_world):
    """Three trained versions, each pushed as adapters alone: the engine samples with each (every
    token tagged with its version) and its logprobs equal the learner's; the bytes of a push are
    the adapters' (fp32, the fused A once); the engine's base is the learner's frozen base."""
    cfg = _lora_cfg()
    worker = LearnerWorker(cfg, VOCAB, pad_id=0)
    learner = worker.learner
    adapter_bytes = sum(p.numel() * 4 for n, p in learner.module.named_parameters() if is_adapter_name(n))
    prompts = [[(5 * i + j) % 40 + 1 for j in range(3 + 2 * i)] for i in range(6)]
    params = SamplingParams(max_new_tokens=12)

    async def run():
        engine = EmbeddedEngine(cfg.model, VOCAB, seed=3, lora=cfg.lora)
        transport = AdapterTransport([engine], None, 60.0, worker=worker)
        rounds = []
        for version in range(4):
            if version:  # two steps: the first moves B only (A's gradient is zero while B is)
                for _ in range(2):
                    learner.train_step(copy.deepcopy(batch()), 1.0, lr=3e-2)
            metrics = (await transport.push(version)).as_dict()
            trajs = await generate_all(engine, prompts, params, tag=f"v{version}-")
            rounds.append((metrics, trajs, _gap(learner, trajs)))
            with adapters_disabled(learner.module):
                rounds[-1] += (_gap(learner, trajs),)
        engine_state = {k: v.clone() for k, v in engine.model.state_dict().items() if isinstance(v, torch.Tensor)}
        await engine.shutdown()
        return rounds, engine_state

    rounds, engine_state = asyncio.run(run())
    for version, (metrics, trajs, gap, base_gap) in enumerate(rounds):
        print(f"version {version}: {metrics['sync/bytes']:.0f} bytes in {metrics['sync/seconds'] * 1e3:.1f} ms, "
              f"engine vs learner {gap:.1e} (vs the base without adapters {base_gap:.1e})")
        assert all(t.versions == [version] * len(t.response_ids) for t in trajs)
        assert gap <= TOL
        if version:
            assert metrics["sync/adapter_only"] == 1.0 and metrics["sync/bytes"] == adapter_bytes
            assert base_gap > 1e-2  # the adapters matter: a base-only engine would be far off
    assert rounds[0][0]["sync/adapter_only"] == 0.0 and rounds[0][0]["sync/bytes"] > 10 * adapter_bytes
    learner_state = learner.module.state_dict()
    assert all(torch.equal(engine_state[k], learner_state[k]) for k in engine_state if k in learner_state)


def test_adapters_to_an_engine_without_lora_are_refused(megatron_world):
    from megatron_rl.api.engine import EngineError

    cfg = _lora_cfg()
    worker = LearnerWorker(cfg, VOCAB, pad_id=0)

    async def run():
        engine = EmbeddedEngine(cfg.model, VOCAB, seed=3)
        try:
            await AdapterTransport([engine], None, 60.0, worker=worker).push(0)
        finally:
            await engine.shutdown()

    with pytest.raises(EngineError, match="engine built without them"):
        asyncio.run(run())


@pytest.mark.parametrize("separate_process, sync", [(False, "adapters"), (True, "adapters"), (False, "merged")],
                         ids=["in-process", "engine-process", "merged"])
def test_lora_run_syncs_adapters_only(megatron_world, tmp_path, separate_process, sync):
    """tiny_cpu with LoRA, on-policy: each step's sync after the first carries the adapters alone,
    the engine's behaviour logprobs are the learner's and the sync probe agrees. lora.sync=merged
    sends the merged weights every step instead (InProcessTransport)."""
    from megatron_rl.build import build_trainer
    from megatron_rl.weights.transports import InProcessTransport

    cfg = load_config("tiny_cpu", [
        f"trainer.run_dir={tmp_path}", "trainer.total_steps=3", "trainer.progress=false",
        "trainer.save_final_checkpoint=false", "scheduler.max_staleness=0", "algo.groups_per_batch=2",
        "algo.group_size=2", "learner.mini_batches=1", "lora.rank=4", "learner.lr=3e-2", "rollout.check_sync=true",
        "rollout.max_model_len=32",
        f"rollout.separate_process={str(separate_process).lower()}", f"lora.sync={sync}"])
    trainer = build_trainer(cfg)
    assert isinstance(trainer.transport, AdapterTransport if sync == "adapters" else InProcessTransport)
    trainer.run()
    adapter_bytes = sum(p.numel() * 4 for n, p in trainer.worker.learner.module.named_parameters()
                        if is_adapter_name(n))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print([(r.get("sync/bytes"), r["sync/seconds"], r["sync/probe_gap"], r["train/behav_logprob_gap"]) for r in rows])
    assert len(rows) == 3
    if sync == "adapters":
        assert all(r["sync/adapter_only"] == 1.0 and r["sync/bytes"] == adapter_bytes for r in rows)
    else:
        assert not any("sync/adapter_only" in r for r in rows)
    assert all(r["sync/probe_gap"] <= TOL and r["train/behav_logprob_gap"] <= TOL for r in rows)


def test_a_vllm_push_streams_its_base_and_keeps_the_adapters_aside():
    """The vLLM engine's split of a push pulls the base's tensors one at a time as the loader
    takes them (a full model's push is never held at once) and collects the adapters met on the
    way; a push of adapters alone has no base."""
    from megatron_rl.rollout.vllm.engine import _split_adapters

    pulled = []

    def push(names):
        for name in names:
            pulled.append(name)
            yield name, torch.zeros(1)

    lora_a = "decoder.layers.0.self_attention.linear_qkv.lora_a"
    lora_b = "decoder.layers.0.self_attention.linear_qkv.lora_b"
    base, adapters = _split_adapters(push(["model.embed_tokens.weight", lora_a, "lm_head.weight", lora_b]))
    assert pulled == ["model.embed_tokens.weight"] and not adapters
    first = next(base)
    assert first[0] == "model.embed_tokens.weight" and len(pulled) == 1
    assert [name for name, _ in base] == ["lm_head.weight"]
    assert sorted(adapters) == [lora_a, lora_b] and len(pulled) == 4
    pulled.clear()
    base, adapters = _split_adapters(push([lora_a, lora_b]))
    assert base is None and sorted(adapters) == [lora_a, lora_b]
    assert _split_adapters(iter([])) == (None, {})
