"""Agents: trajectories from recorded turns (hand-computed), tool-call parsing, the chat server
through the real openai client, agents loaded by import path, and end-to-end training checked
token for token against what the engine produced."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent_helpers import (GSM8K, RecordingEngine, agent_overrides, check_token_for_token, recording_trainer,
                           write_tokenizer)

from megatron_rl.rollout.agent import Turn, run_trajectories
from megatron_rl.rollout.agent.tool_calls import parse_tool_calls


def test_turns_that_extend_the_sequence_make_one_trajectory_with_masks():
    t1 = Turn([1, 2, 3], [10, 11], [-0.1, -0.2], [0, 0], "stop")
    t2 = Turn([1, 2, 3, 10, 11, 7, 8], [12], [-0.3], [1], "length")
    (traj,) = run_trajectories([t1, t2], "p", 4, reward=0.5)
    assert traj.prompt_ids == [1, 2, 3]
    assert traj.response_ids == [10, 11, 7, 8, 12]
    assert traj.loss_mask == [1, 1, 0, 0, 1]
    assert traj.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert traj.versions == [0, 0, 0, 0, 1]
    assert (traj.reward, traj.sample_index, traj.finish_reason, traj.advantage_scale) == (0.5, 4, "length", 1.0)


def test_a_turn_that_rewrites_history_starts_a_new_trajectory_with_discount():
    t1 = Turn([1, 2], [10], [-0.1], [0], "stop")
    t2 = Turn([1, 2, 10, 5], [11], [-0.2], [0], "stop")
    t3 = Turn([1, 9], [12, 13], [-0.3, -0.4], [1, 1], "stop")  # does not extend [1, 2, 10, 5, 11]
    first, second = run_trajectories([t1, t2, t3], "p", 0, reward=1.0, turn_discount=0.5)
    assert (first.prompt_ids, first.response_ids, first.loss_mask) == ([1, 2], [10, 5, 11], [1, 0, 1])
    assert (second.prompt_ids, second.response_ids, second.loss_mask) == ([1, 9], [12, 13], [1, 1])
    assert (first.advantage_scale, second.advantage_scale) == (0.5, 1.0)  # one model turn after it


def test_group_advantages_count_one_run_once():
    from megatron_rl.algorithms.advantages import sample_advantages
    from megatron_rl.checks import load_config

    algo = load_config("tiny_cpu", ["algo.name=dr_grpo"]).algo
    run0 = run_trajectories([Turn([1], [2], [0.0], [0], "stop"), Turn([5], [6], [0.0], [0], "stop")], "p", 0,
                            reward=1.0, turn_discount=0.5)
    run1 = run_trajectories([Turn([1], [3], [0.0], [0], "stop")], "p", 1, reward=0.0)
    group = run0 + run1
    # dr_grpo: reward minus the group mean over the two runs (0.5), not over three trajectories.
    assert sample_advantages([group], [[t.reward for t in group]], algo) == [[0.25, 0.5, -0.5]]


def test_tool_calls_are_parsed_and_bad_blocks_stay_text():
    content, calls = parse_tool_calls('Let me compute.<tool_call>\n{"name": "python", "arguments": {"code": "print(2)"}}\n'
                                      '</tool_call>')
    assert content == "Let me compute."
    assert calls[0]["function"] == {"name": "python", "arguments": '{"code": "print(2)"}'}
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tokenizer")
    write_tokenizer(path)
    return path


def test_calculator_agent_trains_and_every_token_is_the_engines(megatron_world, chat_tokenizer_dir, tmp_path):
    from megatron_rl.checks import load_config

    trainer, trained = recording_trainer(load_config("tiny_cpu", agent_overrides(chat_tokenizer_dir, tmp_path / "run")))
    summary = trainer.run()
    assert summary["steps"] == 2 and len(trained) == 2
    groups = [g for batch in trained for g in batch]
    used, trajs = check_token_for_token(groups, trainer.engine.calls)
    # Multi-turn: the runs made more calls than there are runs, and the prompts carry the chat
    # template's markers (ChatML) and the tools' description.
    runs = {(t.prompt_uid, t.sample_index) for t in trajs}
    trained_calls = [c for c in trainer.engine.calls if c[0] in used]
    assert len(trained_calls) > len(runs)
    assert any(0 in t.loss_mask for t in trajs)
    tok = trainer.tokenizer
    first_prompt = tok.decode_with_specials(trajs[0].prompt_ids)
    assert first_prompt.startswith("<|im_start|>system\n") and '"name": "python"' in first_prompt
    assert first_prompt.endswith("<|im_start|>assistant\n")
    # Every call of a trained run is in its trajectories (the tags are <group>-<uid>-<i>-t<turn>).
    trained_runs = {rid.rsplit("-t", 1)[0] for rid in used}
    assert {rid for rid, _, _ in trainer.engine.calls if rid.rsplit("-t", 1)[0] in trained_runs} == used


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, chat_tokenizer_dir):
    """A random Qwen2 checkpoint directory whose tokenizer.json and chat template were written
    offline (the module's chat tokenizer), with the vocabulary sized to it."""
    import shutil

    from hf_helpers import save_random_hf_model

    from megatron_rl.data.tokenizer import load_pretrained_tokenizer

    path = tmp_path_factory.mktemp("hf_chat")
    vocab = load_pretrained_tokenizer(str(chat_tokenizer_dir)).vocab_size
    save_random_hf_model("qwen2", path, vocab_size=vocab, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(chat_tokenizer_dir / name, path / name)
    return path


def _capture_training(trainer):
    trained = []
    real_train_on = trainer.train_on

    def train_on(prompts, groups, version):
        trained.append((list(prompts), [list(g) for g in groups]))
        return real_train_on(prompts, groups, version)

    trainer.train_on = train_on
    return trained


def test_two_steps_from_an_hf_directory_encode_prompts_with_its_tokenizer_and_chat_template(
        megatron_world, hf_dir, tmp_path):
    import json as _json

    from tokenizers import Tokenizer as HFTokenizer

    from megatron_rl.checks import load_config
    from megatron_rl.build import build_trainer

    cfg = load_config("tiny_cpu", [
        f"model.path={hf_dir}", "data.tokenizer=model", "data.template=chat", "data.name=gsm8k",
        f"data.path={GSM8K}", "data.max_prompt_tokens=400",
        "reward.name=gsm8k", "rollout.max_new_tokens=4", "trainer.total_steps=2", f"trainer.run_dir={tmp_path}",
        "trainer.progress=false", "trainer.save_final_checkpoint=false", "algo.group_size=2",
        "algo.groups_per_batch=2", "learner.mini_batches=1"])
    trainer = build_trainer(cfg)
    trained = _capture_training(trainer)
    assert trainer.run()["steps"] == 2
    # The checkpoint's files, read independently: the tokenizer.json ids of the template's text.
    backend = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    im_end = backend.token_to_id("<|im_end|>")
    assert trainer.params.stop_token_ids[0] == im_end  # the checkpoint's eos ends responses
    for prompts, groups in trained:
        for prompt, group in zip(prompts, groups):
            text = f"<|im_start|>user\n{prompt.question}<|im_end|>\n<|im_start|>assistant\n"
            assert prompt.text == text
            ids = backend.encode(text, add_special_tokens=False).ids
            assert all(list(t.prompt_ids) == ids for t in group)
            assert ids[0] == backend.token_to_id("<|im_start|>")
    assert _json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"] in trainer.tokenizer.chat_template.source


def test_an_agent_function_loaded_by_import_path_trains(megatron_world, hf_dir, tmp_path):
    """``async def run_agent_return_reward(data)`` making its own client with openai_client()."""
    from megatron_rl.checks import load_config
    from megatron_rl.build import build_trainer

    cfg = load_config("tiny_cpu", [f"model.path={hf_dir}",
                                   *agent_overrides(hf_dir, tmp_path, "agent_helpers:run_agent_return_reward")])
    trainer = build_trainer(cfg)
    trainer.engine = RecordingEngine(trainer.engine)
    trained = _capture_training(trainer)
    assert trainer.run()["steps"] == 2
    groups = [g for _, batch in trained for g in batch]
    used, trajs = check_token_for_token(groups, trainer.engine.calls)
    # Two calls per run, the second extending the first: one trajectory per run, two model spans.
    assert len(trajs) == 8 and len(used) == 16
    for t in trajs:
        assert t.loss_mask[0] == 1 and t.loss_mask[-1] == 1 and 0 in t.loss_mask
        assert t.reward in (0.0, 1.0)


@pytest.mark.parametrize("workflow, message", [
    ("no_such_pkg.agents:Agent", "module 'no_such_pkg' is not importable"),
    ("agent_helpers:Missing", "'agent_helpers' has no attribute 'Missing'"),
    ("agent_helpers:GSM8K", "is a PosixPath; point it at an agent class"),
    ("agent_helpers:ExtraParam", "ExtraParam.run(data, client, budget) has a parameter `budget` "
                                 "the trainer cannot fill: a run is handed data and, by name, client, base_url, "
                                 "api_key, http_client"),
    ("agent_helpers:NotAsync", "class NotAsync needs a method `async def run(self, data, ...) -> float`"),
    ("agent_helpers:no_data", "no_data() takes no `data` argument first"),
    ("agent_helpers:NeedsArgs", "NeedsArgs() cannot be called (missing a required argument: 'max_turns'); give its "
                                "required arguments in rollout.agent_args"),
    ("agent_helpers:write_tokenizer", "is a function; point it at an agent class"),
    ("agent_helpers:", "is not an import path"),
])
def test_a_wrong_agent_path_or_signature_is_one_clear_line(workflow, message):
    from megatron_rl.checks import load_config
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config("tiny_cpu", [f"rollout.workflow={workflow}"])
    text = str(err.value)
    assert message in text and "\n" not in text and text.startswith("rollout.workflow=")


def test_an_agent_returning_no_number_stops_the_run_with_one_line(megatron_world, hf_dir, tmp_path, capsys):
    from megatron_rl.checks import load_config
    from megatron_rl.main import run_guarded
    from megatron_rl.build import build_trainer

    cfg = load_config("tiny_cpu", [f"model.path={hf_dir}", *agent_overrides(hf_dir, tmp_path, "agent_helpers:ReturnsText")])
    assert run_guarded(build_trainer(cfg).run) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "megatron_rl: error: rollout.workflow='agent_helpers:ReturnsText': the agent returned '1.0' (str); "
        "it must return the run's reward as a finite float")


def test_calculator_tool_runs_code_in_the_sandbox_and_reports_errors():
    from megatron_rl.rollout.agent.calculator import run_python_tool

    assert asyncio.run(run_python_tool(json.dumps({"code": "print(17 * 23)"}))) == "391\n"
    assert asyncio.run(run_python_tool(json.dumps({"code": "1/0"}))).startswith("error: crash")
    assert "ZeroDivisionError" in asyncio.run(run_python_tool(json.dumps({"code": "1/0"})))
    assert asyncio.run(run_python_tool("not json")).startswith("error: arguments must be")


def test_chat_template_renders_tool_calls_and_results_back_into_the_history(chat_tokenizer_dir):
    from megatron_rl.data.tokenizer import load_pretrained_tokenizer
    from megatron_rl.rollout.agent.tool_calls import messages_for_template

    tok = load_pretrained_tokenizer(str(chat_tokenizer_dir))
    content, calls = parse_tool_calls('ok<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    messages = messages_for_template([{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": content, "tool_calls": calls},
                                      {"role": "tool", "tool_call_id": calls[0]["id"], "content": "1\n"}])
    text = tok.chat_template.render(messages, tools=[{"type": "function", "function": {"name": "python"}}])
    assert text.endswith('<|im_start|>assistant\nok<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}'
                         '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1\n\n</tool_response><|im_end|>\n'
                         '<|im_start|>assistant\n')


def test_vocabulary_error_points_at_data_tokenizer_model(hf_dir):
    from megatron_rl.checks import load_config
    from megatron_rl.models.pretrained import vocab_size_for

    cfg = load_config("tiny_cpu", [f"model.path={hf_dir}"])
    with pytest.raises(ValueError, match=r"has a vocabulary of \d+: set data.tokenizer=model to use the "
                                         r"checkpoint.s own tokenizer \(tokenizer.json\)$"):
        vocab_size_for(cfg.model, 10**6)
