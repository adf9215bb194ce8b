"""Routing replay (R3) from the trajectory to the learner: the rollout side keeps each position's
first recorded routing (single turn, agent turns, responses continued after a weight update), the
learner lays it out per micro-batch in the router's token order and replays it in every forward
(proximal logprobs, the update, the reference model), and reports agreement and expert load."""

import asyncio
import copy

import numpy as np
import pytest
import torch

from megatron_rl.types import GenerationChunk, SamplingParams, Trajectory

LAYERS, TOP_K, EXPERTS = 2, 2, 4


def _routing(positions: int, seed: int) -> np.ndarray:
    """Random top-k choices (distinct experts per token) for ``positions`` positions, uint8."""
    gen = np.random.default_rng(seed)
    picks = np.stack([np.stack([gen.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)])
                      for _ in range(positions)])
    return np.sort(picks, axis=-1).astype(np.uint8)


# ---------------------------------------------------------------- rollout side
class _OneShotEngine:
    """Answers every request with one whole chunk whose routing covers prompt + response but the
    last token (what the engine computes); the response's second half as if generated after a
    weight update (version 1) with a routing of its own."""

    def __init__(self, response_len: int):
        self.response_len = response_len

    async def generate_n(self, request_ids, prompt_ids, params):
        n = self.response_len
        out = []
        for i, rid in enumerate(request_ids):
            positions = len(prompt_ids) + n - 1
            before, after = _routing(positions, seed=i), _routing(positions, seed=100 + i)
            cut = len(prompt_ids) + n // 2
            routed = np.concatenate([before[:cut], after[cut:]])  # each token's own, across the update
            out.append(GenerationChunk(rid, list(range(5, 5 + n)), [-1.0] * n, [0] * (n // 2) + [1] * (n - n // 2),
                                       "length", routed_experts=routed))
        return out


def test_single_turn_trajectory_keeps_the_engines_routing_of_every_position():
    from megatron_rl.data.datasets import Prompt
    from megatron_rl.rollout.workflow import single_turn_group

    prompt = Prompt(uid="u", text="", prompt_ids=[1, 2, 3], target="")
    engine = _OneShotEngine(response_len=6)
    trajs = asyncio.run(single_turn_group(engine, prompt, SamplingParams(max_new_tokens=6), ["a", "b"]))
    chunks = asyncio.run(engine.generate_n(["a", "b"], [1, 2, 3], None))
    for traj, chunk in zip(trajs, chunks):
        assert traj.routed_experts.shape == (3 + 6, LAYERS, TOP_K) and traj.routed_experts.dtype == np.uint8
        # The rows the engine recorded, across the weight update, unchanged; the last token unrecorded.
        assert np.array_equal(traj.routed_experts[:-1], chunk.routed_experts)
        assert (traj.routed_experts[-1] == 255).all()


def test_agent_turns_keep_each_positions_first_record():
    """A second turn re-computes the first turn's tokens (its prompt contains them), here after a
    weight update with other choices: the trajectory keeps the first turn's routing for them,
    and takes the second turn's for what the first never computed (its last token, the tool
    output, the new completion)."""
    from megatron_rl.rollout.agent.trajectories import Turn, run_trajectories

    first_prompt, first_completion = [1, 2, 3], [10, 11, 12]
    tool = [20, 21]
    second_prompt = first_prompt + first_completion + tool
    second_completion = [30, 31]
    first = Turn(first_prompt, first_completion, [-1.0] * 3, [0] * 3, "stop",
                 routed_experts=_routing(len(first_prompt) + len(first_completion) - 1, seed=1))
    second = Turn(second_prompt, second_completion, [-1.0] * 2, [1] * 2, "stop",
                  routed_experts=_routing(len(second_prompt) + len(second_completion) - 1, seed=2))
    [traj] = run_trajectories([first, second], "u", 0, reward=1.0)
    n = len(second_prompt) + len(second_completion)
    assert traj.routed_experts.shape == (n, LAYERS, TOP_K)
    computed_first = len(first_prompt) + len(first_completion) - 1
    assert np.array_equal(traj.routed_experts[:computed_first], first.routed_experts)
    assert not np.array_equal(second.routed_experts[:computed_first], first.routed_experts)
    assert np.array_equal(traj.routed_experts[computed_first : n - 1], second.routed_experts[computed_first:])
    assert (traj.routed_experts[n - 1] == 255).all()


def test_turns_without_routing_give_none():
    from megatron_rl.rollout.agent.trajectories import Turn, run_trajectories

    [traj] = run_trajectories([Turn([1, 2], [3], [-1.0], [0], "stop")], "u", 0, reward=0.0)
    assert traj.routed_experts is None
