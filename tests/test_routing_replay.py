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

from batches import replacing

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


# ---------------------------------------------------------------- learner side
def test_micro_batch_routing_is_in_the_routers_token_order():
    """Row b's place s is token s·rows + b; padding, filler rows and unrecorded places are 255."""
    from megatron_rl.learner.batch import build_micro_batches

    trajs = [Trajectory("p", i, [1, 2], [3] * k, [-1.0] * k, [0] * k, "stop", routed_experts=_routing(2 + k, seed=i))
             for i, k in enumerate([1, 3])]
    trajs[0].routed_experts[-1] = 255  # the engine never computes a response's last token
    [mb] = build_micro_batches(trajs, token_budget=100, equal_shape=True)
    rows, s = mb.tokens.shape
    assert mb.routing.shape == (LAYERS, s * rows, TOP_K) and mb.routing.dtype == torch.uint8
    for b, traj in enumerate(trajs):
        n = len(traj.prompt_ids) + len(traj.response_ids)
        for place in range(s):
            got = mb.routing[:, place * rows + b].numpy()
            want = traj.routed_experts[place] if place < n else np.full((LAYERS, TOP_K), 255)
            assert np.array_equal(got, want), (b, place)
    dense = [Trajectory("p", 0, [1, 2], [3], [-1.0], [0], "stop")]
    assert build_micro_batches(dense, token_budget=100)[0].routing is None  # nothing to carry, nothing built


def test_shared_prompt_forward_takes_each_groups_prompt_routing_once():
    from megatron_rl.learner.batch import build_shared_micro_batches

    trajs = [Trajectory("p", i, [1, 2, 3], [4 + i] * k, [-1.0] * k, [0] * k, "stop",
                        routed_experts=_routing(3 + k, seed=i)) for i, k in enumerate([2, 3])]
    [mb] = build_shared_micro_batches(trajs, token_budget=100)
    groups, s = mb.shared.tokens.shape
    assert groups == 1 and mb.routing.shape == (LAYERS, s * groups, TOP_K)
    # The shared row: the prompt (first sample's routing), then each response at its own positions.
    want = np.concatenate([trajs[0].routed_experts[:3], trajs[0].routed_experts[3:], trajs[1].routed_experts[3:]])
    assert np.array_equal(mb.routing[:, : len(want)].permute(1, 0, 2).numpy(), want)
    assert (mb.routing[:, len(want):] == 255).all()


class _ExpertsUsed:
    """Every forward of the learner's models: the micro-batch's recorded routing and the experts
    each MoE layer used."""

    def __init__(self, learner, models):
        from megatron_rl.models.routing import moe_layers, record_routing

        self.forwards = []
        route = learner._route_as_recorded

        def remember(mb):
            self.forwards.append((mb.routing, {}))
            route(mb)

        learner._route_as_recorded = remember
        for model in models:
            record_routing(model)
            for layer in moe_layers(model):
                layer.register_forward_hook(
                    lambda m, args, out: self.forwards[-1][1].__setitem__(m.moe_index, m.choices.clone()))

    def check_and_reset(self) -> int:
        """Assert every recorded choice was the one used; return how many tokens × layers were checked."""
        checked = 0
        for routing, used in self.forwards:
            assert sorted(used) == list(range(LAYERS))
            for index, choices in used.items():
                target = routing[index]
                known = target[:, 0] != 255
                assert torch.equal(choices[known], target[known]), index
                checked += int(known.sum())
        self.forwards = []
        return checked


def _max_gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("perturb, recompute", [("router_weights", False), ("choice_bias", False),
                                               ("router_weights", True)],
                         ids=["router_weights", "choice_bias", "router_weights-recompute"])
def test_replay_makes_a_perturbed_learner_use_the_engines_experts(megatron_world, perturb, recompute):
    """The engine's routing recorded, then the learner's router perturbed so that some of its own
    choices differ (its weights; or, with DeepSeek-V3's sigmoid router, only the bias that steers
    the choice): without replay ``moe/router_agreement`` < 1 and the logprob gap grows; with
    replay every forward (proximal logprobs, the update, the reference model) uses exactly the
    engine's experts per token and layer, and the gap returns to the unperturbed level (exactly,
    when the perturbation moved only the choice). With full activation recompute, the recompute
    in the backward replays its micro-batch's routing too."""
    from megatron_rl.learner.learner import Learner
    from parallel_cases import VOCAB, batch, engine_view, tiny_cfg

    cfg = tiny_cfg(moe=True)
    cfg.algo.routing_replay = "rollout"
    cfg.algo.kl_coef = 0.01  # a reference model, replayed too
    cfg.learner.recompute_activations = recompute
    if perturb == "choice_bias":
        cfg.model.moe_router_score_function, cfg.model.moe_router_expert_bias = "sigmoid", True
    learner = Learner(cfg, VOCAB)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in learner.module.parameters():  # off Megatron's init: routers with clear preferences
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    trajs = batch()
    engine_logprobs, routed = engine_view(learner.module, trajs)
    trajs = replacing(trajs, logprobs=engine_logprobs, routed_experts=routed)
    recorded = sum(len(t.prompt_ids) + len(t.response_ids) - 1 for t in trajs) * LAYERS
    unperturbed_gap = _max_gap(learner.compute_logprobs(trajs, 1.0), engine_logprobs)
    assert learner.routing_stats.pop_metrics()["moe/router_agreement"] == 1.0

    with torch.no_grad():
        for name, p in learner.module.named_parameters():
            if perturb == "router_weights" and name.endswith("router.weight"):
                p.add_(0.003 * torch.randn(p.shape, generator=gen))
        for name, buf in learner.module.named_buffers():
            if perturb == "choice_bias" and name.endswith("expert_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    learner.ref_model.load_state_dict(learner.module.state_dict())  # a reference that routes as the learner

    learner.replay_routing = False
    free_gap = _max_gap(learner.compute_logprobs(trajs, 1.0), engine_logprobs)
    agreement = learner.routing_stats.pop_metrics()["moe/router_agreement"]
    assert agreement < 1.0

    learner.replay_routing = True
    used = _ExpertsUsed(learner, [learner.module, learner.ref_model])
    replayed_gap = _max_gap(learner.compute_logprobs(trajs, 1.0), engine_logprobs)
    assert used.check_and_reset() == recorded
    replayed_ref_gap = _max_gap(learner.compute_logprobs(trajs, 1.0, reference=True), engine_logprobs)
    assert used.check_and_reset() == recorded
    learner.force_proximal_forward = True  # a proximal pass, the reference's, then the update's forward
    metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-4)
    assert used.check_and_reset() == 3 * recorded
    print(f"{perturb}: agreement without replay {agreement:.3f}, logprob gap unperturbed {unperturbed_gap:.1e}, "
          f"perturbed {free_gap:.1e}, replayed {replayed_gap:.1e} (reference {replayed_ref_gap:.1e}), "
          f"train/behav_logprob_gap {metrics['train/behav_logprob_gap']:.1e}")
    assert metrics["moe/router_agreement"] < 1.0 and metrics["moe/expert_load_max_over_mean"] >= 1.0
    assert replayed_ref_gap == replayed_gap
    if perturb == "choice_bias":
        assert free_gap > 1e-3 and replayed_gap <= unperturbed_gap + 1e-6
    else:  # the weights moved the routing probabilities a little too
        assert replayed_gap < free_gap / 5


def test_learner_refuses_replay_its_moe_layers_cannot_do(megatron_world, monkeypatch):
    """MoE layers that are megatron-core's own (SequentialMLP here; TransformerEngine's grouped MLP
    on a GPU with TransformerEngine) take no replay: an explicit request is refused in one line,
    auto turns it off. (Config validation refuses the SequentialMLP case earlier; this guards the
    learner's actual layers, which the config cannot see.)"""
    import megatron_rl.learner.learner as learner_module

    from megatron_rl.config import ConfigError
    from megatron_rl.learner.learner import Learner
    from parallel_cases import VOCAB, tiny_cfg

    cfg = tiny_cfg(moe=True)
    cfg.model.moe_grouped_experts = False
    cfg.algo.routing_replay = "rollout"
    with pytest.raises(ConfigError) as info:
        Learner(cfg, VOCAB)
    assert "MoE layers of this learner are megatron-core's own" in str(info.value)
    assert "\n" not in str(info.value)
    cfg.algo.routing_replay = "auto"
    monkeypatch.setattr(learner_module, "routing_replay_on", lambda cfg: True)  # as auto resolves where TE is
    assert Learner(cfg, VOCAB).replay_routing is False


def test_shared_prompt_forward_replays_as_plain_rows(megatron_world):
    """learner.share_prompts runs each group's prompt once: with routing that the learner's own
    router partly disagrees with, its replayed logprobs equal those of plain rows."""
    from megatron_rl.learner.learner import Learner
    from parallel_cases import VOCAB, batch, engine_view, tiny_cfg

    learner = Learner(tiny_cfg(moe=True), VOCAB)
    gen = torch.Generator().manual_seed(7)
    routers = {n: p for n, p in learner.module.named_parameters() if n.endswith("router.weight")}
    with torch.no_grad():
        for p in learner.module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
        saved = {n: p.clone() for n, p in routers.items()}
        for p in routers.values():  # an engine whose routers differ a little
            p.add_(0.003 * torch.randn(p.shape, generator=gen))
        trajs = batch()
        _, routed = engine_view(learner.module, trajs)
        for n, p in routers.items():
            p.copy_(saved[n])
    trajs = replacing(trajs, routed_experts=routed)
    plain = learner.compute_logprobs(trajs, 1.0)
    assert learner.routing_stats.pop_metrics()["moe/router_agreement"] < 1.0
    learner.cfg.learner.share_prompts = True
    shared = learner.compute_logprobs(trajs, 1.0)
    learner.replay_routing = False
    free = learner.compute_logprobs(trajs, 1.0)
    assert _max_gap(shared, plain) <= 1e-5 < _max_gap(free, plain)
