"""The weight transports (``weights/transports.py``): the registry picks one per engine kind and
placement and refuses an unknown combination with one line; a dead engine, a push that takes
too long and a receiver handed another version are each named in one place."""

import asyncio
import os
import signal
from pathlib import Path

import pytest

import megatron_rl
from megatron_rl.errors import ConfigError
from megatron_rl.api.engine import EngineError
from megatron_rl.weights.transport_registry import TRANSPORTS, transport_for
from megatron_rl.weights.transports import BroadcastSender, ChannelReceiver, LocalEngineSender, WorldReceiver, check_version


@pytest.mark.parametrize("kind, placement, name, sender, receiver", [
    ("embedded", "one_process", "in_process", None, None),
    ("vllm", "one_process", "in_process", None, None),
    ("embedded", "colocated", "colocated", LocalEngineSender, None),
    ("vllm", "colocated", "colocated", LocalEngineSender, None),
    ("embedded", "disaggregated", "world_broadcast", BroadcastSender, WorldReceiver),
    ("vllm", "disaggregated", "vllm_channel", BroadcastSender, ChannelReceiver),
    ("a_plugin_engine", "one_process", "in_process", None, None),
    ("a_plugin_engine", "colocated", "colocated", LocalEngineSender, None),
    ("a_plugin_engine", "disaggregated", "world_broadcast", BroadcastSender, WorldReceiver),
])
def test_each_engine_kind_and_placement_has_its_transport(kind, placement, name, sender, receiver):
    entry = transport_for(kind, placement)
    assert (entry.name, entry.sender, entry.receiver) == (name, sender, receiver)


def test_the_registry_holds_no_combination_the_test_above_does_not_name():
    assert len(TRANSPORTS) == 9  # the six above and any other engine in each placement


@pytest.mark.parametrize("kind, placement", [("sglang", "elsewhere"), ("embedded", "elsewhere")])
def test_an_unknown_combination_is_refused_with_one_line_naming_it(kind, placement):
    with pytest.raises(ConfigError) as err:
        transport_for(kind, placement)
    message = str(err.value)
    assert "\n" not in message
    assert f"rollout.engine={kind}" in message and f"the {placement} placement" in message
    assert "embedded disaggregated" in message  # what exists


def test_a_receiver_handed_another_version_fails_naming_both():
    check_version(3, 3.0)  # vLLM's status carries the version as a float
    with pytest.raises(EngineError, match=r"asked to receive weights v4, the learners sent v3"):
        check_version(4, 3)


def test_the_messages_of_a_dead_engine_and_a_wrong_version_are_written_once():
    package = Path(megatron_rl.__file__).parent
    for phrase in ("the rollout engine is gone", "asked to receive weights v"):
        holders = [p.relative_to(package).as_posix() for p in package.rglob("*.py") if phrase in p.read_text()]
        assert len(holders) == 1, (phrase, holders)


def _engine_process():
    from megatron_rl.config.schema import RootConfig
    from megatron_rl.rollout.embedded import EngineProcess

    cfg = RootConfig()
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 64, 128
    cfg.model.num_attention_heads, cfg.model.num_query_groups, cfg.model.num_layers = 4, 2, 2
    return cfg, EngineProcess(cfg.model, 48, seed=3)


def test_a_push_to_a_dead_engine_stops_the_run_naming_it(megatron_world):
    from megatron_rl.learner.worker import LearnerWorker
    from megatron_rl.scheduler.controller import RolloutsStopped

    cfg, engine = _engine_process()
    worker = LearnerWorker(cfg, 48, 0)
    push = transport_for("embedded", "one_process").transport([engine], None, 60.0, worker=worker).push

    async def run():
        metrics = await push(1)  # a live engine takes the version
        assert engine.weight_version() == 1 and metrics.as_dict()["sync/seconds"] > 0
        os.kill(engine.pid, signal.SIGKILL)
        for _ in range(200):
            if engine.failure:
                break
            await asyncio.sleep(0.05)
        try:
            await push(2)
        finally:
            await engine.shutdown()

    with pytest.raises(RolloutsStopped, match=r"^the rollout engine is gone \(.*exited"):
        asyncio.run(asyncio.wait_for(run(), 120))


def test_a_push_longer_than_the_timeout_fails_naming_the_key(megatron_world):
    from megatron_rl.learner.worker import LearnerWorker

    cfg, engine = _engine_process()
    worker = LearnerWorker(cfg, 48, 0)
    transport = transport_for("embedded", "one_process").transport([engine], None, 1e-3, worker=worker,
                                                                   report_grace_s=0.1)

    async def run():
        try:
            await transport.push(1)
        finally:
            await engine.shutdown()

    with pytest.raises(EngineError, match=r"weights v1 did not reach the engines within 0.001 s "
                                          r"\(rollout.weight_timeout_s\)"):
        asyncio.run(asyncio.wait_for(run(), 120))


@pytest.mark.parametrize("placement, name, sender, receiver", [
    ("one_process", "in_process_adapters", None, None),
    ("colocated", "colocated_adapters", "AdapterLocalSender", None),
    ("disaggregated", "world_broadcast_adapters", "AdapterBroadcastSender", "AdapterWorldReceiver"),
])
def test_adapter_only_sync_has_an_entry_in_every_placement(placement, name, sender, receiver):
    """lora.sync=adapters with the embedded engine: the base once, then the adapters alone
    (weights/adapter_sync.py); without adapters the same placement keeps its merged transport."""
    entry = transport_for("embedded", placement, adapters=True)
    assert entry.name == name
    assert getattr(entry.sender, "__name__", None) == sender and getattr(entry.receiver, "__name__", None) == receiver
    assert transport_for("embedded", placement).name != name


def test_lora_on_an_engine_without_adapter_support_warns_in_one_line():
    """The embedded engine and vLLM take the adapters in every placement; another registered
    engine takes merged weights, said in one line."""
    from megatron_rl.checks import load_config
    from megatron_rl.models.lora import engine_applies_adapters, merged_fallback

    cfg = load_config("tiny_cpu", ["lora.rank=4"])
    for engine in ("embedded", "vllm"):  # set after loading: validation would ask for the vllm package
        cfg.rollout.engine = engine
        for placement in ("one_process", "colocated", "disaggregated"):
            assert engine_applies_adapters(cfg) and merged_fallback(cfg, placement) is None
    cfg.rollout.engine = "plugin_engine"
    for placement in ("one_process", "colocated", "disaggregated"):
        line = merged_fallback(cfg, placement)
        assert not engine_applies_adapters(cfg) and "\n" not in line
        assert f"rollout.engine=plugin_engine in the {placement} placement receives merged weights" in line
    cfg.lora.sync = "merged"
    assert merged_fallback(cfg, "disaggregated") is None  # asked for merged weights: nothing to warn of
    cfg.rollout.engine = "vllm"
    assert not engine_applies_adapters(cfg)
