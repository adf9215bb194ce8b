"""Agents written for AReaL and agents that build their client from the environment: what a run
is handed (base_url, api_key, http_client, data with every column of its row), constructor
arguments from rollout.agent_args, per-run routing of env-built clients under concurrency, the
error of an agent whose calls never reach the chat server, and per-run metrics."""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import pytest

from agent_helpers import (ArealStyleAgent, ElsewhereAgent, RecordingEngine, agent_overrides, check_token_for_token,
                           closed_port, recording_trainer, write_tokenizer)

from megatron_rl.types import SamplingParams, Trajectory


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tokenizer")
    write_tokenizer(path)
    return path


def _trainer(tokenizer_dir, run_dir, workflow, *extra):
    from megatron_rl.checks import load_config

    return recording_trainer(load_config("tiny_cpu", [*agent_overrides(tokenizer_dir, run_dir, workflow), *extra]))


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_areal_agent_class_trains_two_steps_on_base_url_api_key_and_http_client(megatron_world, chat_tokenizer_dir,
                                                                                   tmp_path):
    """AReaL's shape: ``run(self, data, **extra_kwargs)``, constructor kwargs from rollout.agent_args,
    ``data["messages"]``, ``model="default"``."""
    import httpx2

    ArealStyleAgent.handed.clear()
    trainer, trained = _trainer(chat_tokenizer_dir, tmp_path, "agent_helpers:ArealStyleAgent",
                                "rollout.agent_args.max_turns=2")
    assert trainer.run()["steps"] == 2
    groups = [g for batch in trained for g in batch]
    used, trajs = check_token_for_token(groups, trainer.engine.calls)
    assert len(trajs) == 8 and len(used) == 16  # two calls per run, the second extending the first
    handed = ArealStyleAgent.handed
    assert all(set(h) == {"base_url", "api_key", "http_client", "data"} for h in handed)
    assert all(isinstance(h["http_client"], httpx2.AsyncClient) and h["http_client"].is_closed for h in handed)
    runs = {(t.prompt_uid, t.sample_index) for t in trajs}
    for h in handed:
        run_id = h["base_url"].split("/runs/")[1].split("/")[0]
        assert h["base_url"].endswith(f"/runs/{run_id}/v1") and h["api_key"] == f"megatron_rl-{run_id}"
        assert h["data"]["messages"] == [{"role": "user", "content": h["data"]["question"]}]
    assert {(h["data"]["uid"], int(h["base_url"].split("/v1")[0].rsplit("-", 1)[1])) for h in handed} >= runs
    for row in _metrics(tmp_path):
        assert row["agent/turns_mean"] == 2.0 and row["agent/trajectories_mean"] == 1.0 and row["agent/runs"] == 4


def test_an_agent_building_asyncopenai_from_the_environment_trains_two_steps(megatron_world, chat_tokenizer_dir,
                                                                             tmp_path, monkeypatch, capfd):
    """``AsyncOpenAI()`` with no arguments, with OPENAI_BASE_URL set elsewhere by the user and no
    OPENAI_API_KEY: its calls reach each run's own records; the environment is given back after.
    Runs of two trajectories (a rewritten history) count once in reward/mean."""
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    trainer, trained = _trainer(chat_tokenizer_dir, tmp_path, "agent_helpers:EnvClientAgent")
    assert trainer.run()["steps"] == 2
    groups = [g for batch in trained for g in batch]
    used, trajs = check_token_for_token(groups, trainer.engine.calls)
    assert len(used) == 16  # every call of every trained run, each recorded in its own run
    for step, batch in zip(_metrics(tmp_path), trained):
        flat = [t for g in batch for t in g]
        per_run = {(t.prompt_uid, t.sample_index): t for t in flat}
        assert len(per_run) == 4
        assert step["reward/mean"] == pytest.approx(sum(t.reward for t in per_run.values()) / 4)
        # A run that scored 1 rewrote its history: two trajectories.
        assert all(len([t for t in flat if (t.prompt_uid, t.sample_index) == k]) == 1 + int(t.reward)
                   for k, t in per_run.items())
        assert step["agent/trajectories_mean"] == pytest.approx(1 + step["reward/mean"])
    rewards = [t.reward for t in trajs]
    assert 0.0 in rewards and 1.0 in rewards  # both kinds of run happened: the per-run mean was tested
    assert "OPENAI_BASE_URL set in the environment replaced by the chat server's while agents run" in capfd.readouterr().err
    import os

    assert os.environ["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and "OPENAI_API_KEY" not in os.environ


@pytest.fixture(scope="module")
def chat_tokenizer(chat_tokenizer_dir):
    from megatron_rl.data.tokenizer import load_pretrained_tokenizer

    return load_pretrained_tokenizer(str(chat_tokenizer_dir))


@pytest.fixture(scope="module")
def engine(megatron_world, chat_tokenizer):
    import torch

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    return EmbeddedEngine(ModelConfig(max_position_embeddings=256), chat_tokenizer.vocab_size, max_batch_size=64,
                          seed=0)


def _prompt(row=None):
    from megatron_rl.data.datasets import Prompt

    prompt = Prompt("p0", "What is 2 + 3?", [1, 2, 3], "5", "What is 2 + 3?")
    if row is not None:  # the dataset's whole row, as datasets keep it (Prompt is frozen)
        object.__setattr__(prompt, "row", row)
    return prompt


_RUN_NUMBERS = itertools.count(1000)


async def _interleaved_env_agent(data, client=None):
    """Three calls from clients built from the environment inside the run, each carrying the
    run's own number, with yields between them so that the runs' calls interleave: two from an
    ``AsyncOpenAI()``, the last from a synchronous ``OpenAI()`` in a thread (asyncio.to_thread)."""
    import random

    from openai import AsyncOpenAI, OpenAI

    number = next(_RUN_NUMBERS)
    env_client, sync_client = AsyncOpenAI(max_retries=0), OpenAI(max_retries=0)
    messages = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Run {number}, turn {turn}."})
        if turn < 2:
            reply = await env_client.chat.completions.create(model="policy", max_tokens=2, messages=messages)
        else:
            reply = await asyncio.to_thread(sync_client.chat.completions.create, model="policy", max_tokens=2,
                                            messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        await asyncio.sleep(random.random() * 0.01)
    await env_client.close()
    sync_client.close()
    return float(number)


def test_env_built_clients_of_many_concurrent_runs_each_reach_their_own_run(engine, chat_tokenizer):
    """32 runs at once in one event loop, each with its own ``AsyncOpenAI()`` from the shared
    environment: every recorded call of a run carries that run's number, never another's."""
    from megatron_rl.rollout.agent import AgentSpec, AgentWorkflow

    workflow = AgentWorkflow(AgentSpec("env", _interleaved_env_agent), chat_tokenizer, 256)
    recording = RecordingEngine(engine)

    async def main():
        try:
            return await workflow(recording, _prompt(), SamplingParams(max_new_tokens=2),
                                  [f"g0-p0-{i}" for i in range(32)])
        finally:
            await workflow.close()

    trajs = asyncio.run(main())
    assert len({t.sample_index for t in trajs}) == 32 and len(recording.calls) == 96
    for traj in trajs:
        text = chat_tokenizer.decode_with_specials(traj.prompt_ids + traj.response_ids)
        found = re.findall(r"Run (\d+), turn", text)
        assert found and set(found) == {str(int(traj.reward))}, (traj.sample_index, found, traj.reward)
        assert traj.agent_run["turns"] == 3 and traj.agent_run["context_overflows"] == 0
    assert len({t.reward for t in trajs}) == 32


def test_data_holds_every_column_of_the_row_and_the_trainers_keys_win():
    from megatron_rl.rollout.agent.workflow import run_data

    row = {"question": "raw", "answer": "#### 5", "difficulty": 3, "tests": [{"input": "1"}], "uid": "x"}
    data = run_data(_prompt(row))
    assert data["difficulty"] == 3 and data["tests"] == [{"input": "1"}]
    assert (data["uid"], data["question"], data["prompt"], data["answer"]) == ("p0", "What is 2 + 3?",
                                                                               "What is 2 + 3?", "5")
    data["tests"].append("changed by one run")
    assert run_data(_prompt(row))["tests"] == [{"input": "1"}]  # each run gets its own copy
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]
    assert run_data(_prompt({"messages": messages}))["messages"] == messages  # a row's own messages are kept
    assert set(run_data(_prompt())) == {"uid", "question", "prompt", "answer", "messages"}  # no row (yet)


def test_agent_args_construct_the_agent_class_and_are_checked_at_config_time():
    from megatron_rl.checks import load_config
    from megatron_rl.config import ConfigError
    from megatron_rl.rollout.workflow import resolve_agent

    cfg = load_config("tiny_cpu", ["rollout.workflow=calculator_agent", "rollout.agent_args.max_turns=5"])
    assert cfg.rollout.agent_args == {"max_turns": 5}
    assert resolve_agent(cfg.rollout.workflow, cfg.rollout.agent_args).run.__self__.max_turns == 5
    cfg = load_config("tiny_cpu", ["rollout.workflow=agent_helpers:ArealStyleAgent",
                                   "rollout.agent_args={max_turns:2,temperature:0.5}"])
    agent = resolve_agent(cfg.rollout.workflow, cfg.rollout.agent_args).run.__self__
    assert (agent.max_turns, agent.kwargs) == (2, {"temperature": 0.5})
    cases = {
        ("calculator_agent", "rollout.agent_args.max_turn=5"):
            "CalculatorAgent(max_turn=5) cannot be called (got an unexpected keyword argument 'max_turn'); "
            "rollout.agent_args gives its constructor's keyword arguments",
        ("calculator_agent", "rollout.agent_args.max_turns=0"):
            "CalculatorAgent(max_turns=0) failed: ValueError: max_turns=0 must be an integer of at least 1",
        ("agent_helpers:run_agent_return_reward", "rollout.agent_args.x=1"):
            "is a function, so rollout.agent_args={'x': 1} has nothing to construct",
        ("single_turn", "rollout.agent_args.x=1"):
            "rollout.agent_args={'x': 1} is for agents, but rollout.workflow=single_turn is not one",
    }
    for (workflow, args), message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config("tiny_cpu", [f"rollout.workflow={workflow}", args])
        assert message in str(err.value) and "\n" not in str(err.value)


def test_areal_kwargs_by_name_and_the_client_positionally():
    from megatron_rl.rollout.agent import agent_spec

    class ByName:
        async def run(self, data, base_url=None, http_client=None):
            return 0.0

    class Both:
        async def run(self, data, my_client, **kwargs):
            return 0.0

    class Nothing:
        async def run(self, data):
            return 0.0

    assert (agent_spec(ByName, "x").client_positional, agent_spec(ByName, "x").by_name) == (False,
                                                                                         ("base_url", "http_client"))
    assert agent_spec(Both, "x").wants == ("client", "base_url", "http_client", "api_key")
    assert agent_spec(Nothing, "x").wants == ()


def test_a_dict_of_rewards_per_completion_is_one_clear_line(chat_tokenizer):
    from megatron_rl.rollout.agent import AgentError, AgentSpec, AgentWorkflow
    from megatron_rl.rollout.agent.server import AgentRun

    workflow = AgentWorkflow(AgentSpec("agent_helpers:MultiTurn", _interleaved_env_agent), chat_tokenizer, 256)
    with pytest.raises(AgentError, match=r"returned a dict \(2 entries; rewards per completion, as AReaL allows\); "
                                         r"return the run's reward as one finite float$"):
        workflow.trajectories(AgentRun("r", SamplingParams()), _prompt(), 0, {"chatcmpl-1": 0.0, "chatcmpl-2": 1.0})


def test_per_run_metrics_count_a_run_once():
    from megatron_rl.rollout.agent import agent_metrics, runs

    def traj(uid, index, reward, counts=None):
        t = Trajectory(uid, index, [1], [2], [0.0], [0], "stop", reward=reward)
        t.agent_run = counts
        return t

    two = {"turns": 4, "tool_calls": 2, "context_overflows": 1, "trajectories": 2}
    one = {"turns": 1, "tool_calls": 0, "context_overflows": 0, "trajectories": 1}
    groups = [[traj("a", 0, 1.0, two), traj("a", 0, 1.0, two), traj("a", 1, 0.0, one)], [traj("b", 0, 0.0, one)]]
    assert [t.reward for t in runs(groups)] == [1.0, 0.0, 0.0]  # reward/mean 1/3, not 2/4
    assert agent_metrics(groups) == {"agent/turns_mean": 2.0, "agent/tool_calls_mean": 2 / 3,
                                     "agent/context_overflows_mean": 1 / 3, "agent/trajectories_mean": 4 / 3,
                                     "agent/turns_max": 4.0, "agent/context_overflows": 1.0, "agent/runs": 3.0}
    # The same prompt drawn twice into one batch: two groups, four runs.
    single = [[traj("a", 0, 1.0), traj("a", 1, 0.0)], [traj("a", 0, 1.0), traj("a", 1, 1.0)]]
    assert len(runs(single)) == 4
    assert agent_metrics(single) == {}  # single-turn samples: no agent metrics


def test_an_agent_whose_calls_never_reach_the_server_stops_at_once_with_the_fix(megatron_world, chat_tokenizer_dir,
                                                                                tmp_path, capsys):
    from megatron_rl.main import run_guarded

    sock = closed_port()
    ElsewhereAgent.port = sock.getsockname()[1]
    try:
        trainer, trained = _trainer(chat_tokenizer_dir, tmp_path, "agent_helpers:ElsewhereAgent")
        assert run_guarded(trainer.run) == 1
    finally:
        sock.close()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("megatron_rl: error: rollout.workflow='agent_helpers:ElsewhereAgent': "
                           "the agent's model calls never reached the chat server "
                           "(APIConnectionError: Connection error.); use the client, base_url or api_key handed "
                           "to the run"), line
    assert "The engine answers" not in line and not trained


def test_runs_failing_before_any_call_stop_with_what_to_fix(megatron_world, chat_tokenizer_dir, tmp_path, capsys):
    from megatron_rl.main import run_guarded

    trainer, trained = _trainer(chat_tokenizer_dir, tmp_path, "agent_helpers:FailsBeforeCalling")
    assert run_guarded(trainer.run) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "rollout groups in a row failed and none succeeded" in line
    assert "raised KeyError: 'no_such_column' before any of its calls reached the chat server" in line
    assert "the agent's runs failed before any of their calls reached the chat server: use the client" in line
    assert "The engine answers" not in line and not trained
