"""Shared pieces of the agent tests: a chat tokenizer written offline, a tiny agent run config,
an engine tap that records what the engine produced, and agents to load by import path."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from typing import List, Sequence, Tuple

from megatron_rl.api.engine import RolloutEngine, whole_response
from megatron_rl.types import GenerationChunk

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
if not GSM8K.is_file():
    GSM8K = Path("/work/shared/data/gsm8k/train.jsonl")


def write_tokenizer(directory: Path, vocab_size: int = 1000):
    """A byte-level BPE with ChatML tokens and chat template, trained on 300 GSM8K rows and the
    calculator agent's own texts (so its system prompt and tool list stay short) in under 1 s."""
    from megatron_rl.data.tokenizer import write_chat_tokenizer
    from megatron_rl.rollout.agent.calculator import tokenizer_texts

    rows = [json.loads(line) for line in GSM8K.open()][:300]
    return write_chat_tokenizer(directory, [r["question"] + " " + r["answer"] for r in rows] + tokenizer_texts(),
                                vocab_size)


def agent_overrides(tokenizer_dir: Path, run_dir: Path, workflow: str = "calculator_agent") -> List[str]:
    return ["trainer.total_steps=2", f"trainer.run_dir={run_dir}", "trainer.progress=false",
            "trainer.save_final_checkpoint=false", "algo.group_size=2", "algo.groups_per_batch=2",
            "learner.mini_batches=1", f"rollout.workflow={workflow}", "rollout.max_new_tokens=6",
            "model.max_position_embeddings=512", "data.name=gsm8k", f"data.path={GSM8K}",
            "data.tokenizer=model", f"data.tokenizer_path={tokenizer_dir}", "data.max_prompt_tokens=400",
            "reward.name=gsm8k"]


class RecordingEngine(RolloutEngine):
    """Every request the wrapped engine served, with what it produced (a tap, not a stand-in:
    the tokens come from the real engine)."""

    def __init__(self, inner: RolloutEngine):
        self.inner = inner
        self.calls: List[Tuple[str, List[int], GenerationChunk]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, request_id, prompt_ids, params):
        stream = self.inner.generate(request_id, prompt_ids, params)

        async def tap():
            out = await whole_response(stream)
            self.calls.append((request_id, list(prompt_ids), out))
            yield out

        return tap()

    async def abort(self, request_ids=None):
        await self.inner.abort(request_ids)

    async def pause(self, mode="keep"):
        await self.inner.pause(mode)

    async def resume(self):
        await self.inner.resume()

    async def update_weights(self, named_tensors, version):
        await self.inner.update_weights(named_tensors, version)

    def weight_version(self):
        return self.inner.weight_version()

    async def sampling_state(self):
        return await self.inner.sampling_state()

    async def set_sampling_state(self, state):
        await self.inner.set_sampling_state(state)

    async def sleep(self):
        await self.inner.sleep()

    async def wake_up(self):
        await self.inner.wake_up()

    async def shutdown(self):
        await self.inner.shutdown()


def recording_trainer(cfg):
    """A Trainer whose engine records every call and whose trained groups are kept: returns
    (trainer, trained), ``trained`` a list per step of its groups."""
    from megatron_rl.build import build_trainer

    trainer = build_trainer(cfg)
    trainer.engine = RecordingEngine(trainer.engine)
    trained = []
    real_train_on = trainer.train_on

    def train_on(prompts, groups, version):
        trained.append([list(g) for g in groups])
        return real_train_on(prompts, groups, version)

    trainer.train_on = train_on
    return trainer, trained


def check_token_for_token(groups, calls):
    """Every trajectory's model tokens (mask 1) are exactly an engine output (ids, logprobs,
    versions) whose prompt was exactly the trajectory's tokens before them; every other token has
    mask 0, logprob 0 and the version of the model token before it; every engine call is used."""
    by_prompt = {}
    for request_id, prompt, out in calls:
        by_prompt.setdefault(tuple(prompt), []).append((request_id, out))
    used = set()
    trajs = [t for g in groups for t in g]
    for traj in trajs:
        seq, i, prev_version = list(traj.prompt_ids), 0, None
        n = len(traj.response_ids)
        while i < n:
            if traj.loss_mask[i] == 0:
                assert traj.logprobs[i] == 0.0 and traj.versions[i] == prev_version
                seq.append(traj.response_ids[i])
                i += 1
                continue
            j = i
            while j < n and traj.loss_mask[j] == 1:
                j += 1
            matches = [(rid, out) for rid, out in by_prompt.get(tuple(seq), [])
                       if out.token_ids == traj.response_ids[i:j] and out.logprobs == traj.logprobs[i:j]
                       and out.versions == traj.versions[i:j]]
            assert matches, f"model tokens {i}:{j} of {traj.prompt_uid}/{traj.sample_index} match no engine call"
            used.add(matches[0][0])
            seq += traj.response_ids[i:j]
            prev_version = traj.versions[j - 1]
            i = j
    return used, trajs


# Agents for the import-path tests (rollout.workflow=agent_helpers:<name>).
async def run_agent_return_reward(data) -> float:
    """The function form: it makes its client from the run's base URL."""
    from megatron_rl.rollout.agent import openai_client

    client = openai_client()
    first = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": data["question"]}])
    await client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": data["question"]},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Again."}])
    await client.close()
    return float(len(first.choices[0].message.content or "") % 2)


class ExtraParam:
    async def run(self, data, client, budget):
        return 0.0


class NotAsync:
    def run(self, data, client):
        return 0.0


async def no_data():
    return 0.0


class NeedsArgs:
    def __init__(self, max_turns):
        self.max_turns = max_turns

    async def run(self, data, client):
        return 0.0


class ReturnsText:
    async def run(self, data, client):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return "1.0"


class ArealStyleAgent:
    """In the shape of AReaL's example agents (areal/workflow/openai/math_agent.py): constructor
    keyword arguments, ``run(self, data, **extra_kwargs)`` reading base_url, api_key and
    http_client (falling back to the environment), an AsyncOpenAI on them, ``model="default"``,
    ``data["messages"]``. What each run was handed is kept in ``handed``."""

    handed: List[dict] = []

    def __init__(self, max_turns: int = 1, **kwargs):
        self.max_turns = max_turns
        self.kwargs = kwargs.copy()

    async def run(self, data: dict, **extra_kwargs) -> float:
        from openai import AsyncOpenAI

        ArealStyleAgent.handed.append(dict(extra_kwargs, data=data))
        http_client = extra_kwargs.get("http_client", None)
        base_url = extra_kwargs.get("base_url", None) or os.getenv("OPENAI_BASE_URL")
        api_key = extra_kwargs.get("api_key", None) or os.getenv("OPENAI_API_KEY")
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        messages = data["messages"].copy()
        reward = 0.0
        for _ in range(self.max_turns):
            response = await client.chat.completions.create(messages=messages, model="default", **self.kwargs)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            reward = float(data["answer"] in (message.content or ""))
            messages.append({"role": "user", "content": "Check your answer and try again."})
        return reward


class EnvClientAgent:
    """``run(self, data)`` with a client built from the environment, ``AsyncOpenAI()``. A first
    reply of odd length makes the second call rewrite the history (a second trajectory) and
    scores 1; an even one continues it (one trajectory) and scores 0."""

    async def run(self, data) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI()
        question = [{"role": "user", "content": data["question"]}]
        first = await client.chat.completions.create(model="policy", messages=question)
        text = first.choices[0].message.content or ""
        rewrite = len(text) % 2 == 1
        history = [{"role": "user", "content": "Say it again."}] if rewrite else question + [
            {"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
        await client.chat.completions.create(model="policy", messages=history)
        await client.close()
        return 1.0 if rewrite else 0.0


def closed_port() -> socket.socket:
    """A bound socket that does not listen: connections to its port are refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class ElsewhereAgent:
    """Its client points at a port nobody listens on (set in ``port`` by the test)."""

    port = 9

    async def run(self, data) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return 1.0


class FailsBeforeCalling:
    async def run(self, data, client) -> float:
        await asyncio.sleep(0)
        return float(data["no_such_column"])
