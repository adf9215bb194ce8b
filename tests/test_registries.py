"""Components chosen by config name: each registry lists its components, an unknown name is an
error naming the choices, and a component registered under a new name is a valid config value
that the code path then uses (advantages, rewards, policy losses, engines, workflows)."""

import asyncio
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS, sample_advantages
from megatron_rl.algorithms.policy_loss import (POLICY_LOSSES, cispo_loss, decoupled_ppo_loss, gspo_loss,
                                              ppo_clip_loss)
from megatron_rl.checks import load_config
from megatron_rl.config import ConfigError
from megatron_rl.config.schema import AlgoConfig
from megatron_rl.registry import Registry, UnknownName
from megatron_rl.rewards import REWARDS, RewardRunner, digit_match, gsm8k_exact
from megatron_rl.rollout.build import ENGINES, build_embedded, build_vllm
from megatron_rl.rollout.workflow import WORKFLOWS, generate_groups, single_turn_group
from megatron_rl.types import Trajectory

REGISTRIES = {
    "algo.name": (ADVANTAGE_ESTIMATORS, ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")),
    "algo.policy_loss": (POLICY_LOSSES, ("decoupled", "ppo", "gspo", "cispo", "nll")),
    "reward.name": (REWARDS, ("reverse_digits", "sort_digits", "gsm8k", "math", "code")),
    "rollout.engine": (ENGINES, ("embedded", "vllm")),
    "rollout.workflow": (WORKFLOWS, ("single_turn",)),
}


@contextmanager
def registered(registry: Registry, name: str, obj):
    """``obj`` under ``name`` for the duration of the block, so later tests see the stock names."""
    registry.add(name, obj)
    try:
        yield obj
    finally:
        registry.remove(name)


@pytest.mark.parametrize("key", REGISTRIES)
def test_registry_lists_the_expected_names(key):
    registry, names = REGISTRIES[key]
    assert registry.names() == names
    assert list(registry) == list(names) and len(registry) == len(names)


def test_registries_hold_the_stock_components():
    assert REWARDS["reverse_digits"] is digit_match and REWARDS["sort_digits"] is digit_match
    assert REWARDS["gsm8k"] is gsm8k_exact
    assert ENGINES.get("embedded").build is build_embedded and ENGINES.get("vllm").build is build_vllm
    assert WORKFLOWS.get("single_turn") is single_turn_group


@pytest.mark.parametrize("key", REGISTRIES)
def test_unknown_name_is_an_error_naming_the_choices(key):
    registry, names = REGISTRIES[key]
    with pytest.raises(UnknownName) as err:
        registry.get("nope")
    assert str(err.value) == f"unknown {registry.kind} 'nope'; choose one of {', '.join(names)}"
    # A lookup error and a bad value both: callers catching either one keep working.
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    with pytest.raises(ConfigError, match=f"^{key}='nope' is not allowed; choose one of {', '.join(names)}"):
        load_config("tiny_cpu", [f"{key}=nope"])


def test_registry_refuses_a_taken_name_and_forgets_a_removed_one():
    registry = Registry("thing")

    @registry.register("a")
    def a():
        return 1

    assert registry.get("a") is a and a() == 1  # the decorator returns the function unchanged
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        registry.add("a", object())
    assert registry.remove("a") is a
    assert "a" not in registry and registry.names() == ()
    with pytest.raises(UnknownName, match="unknown thing 'a'; choose one of $"):
        registry.remove("a")


def test_registered_advantage_estimator_is_accepted_and_used():
    def rank_in_group(rewards, lengths, eps, normalize_by_std):
        return rewards.argsort(dim=1).argsort(dim=1).to(rewards.dtype)

    with pytest.raises(ConfigError, match="algo.name='rank' is not allowed"):
        load_config("tiny_cpu", ["algo.name=rank"])
    with registered(ADVANTAGE_ESTIMATORS, "rank", rank_in_group):
        cfg = load_config("tiny_cpu", ["algo.name=rank"])
        groups = [[Trajectory("p", i, [1], [2], [0.0], [0], "stop", loss_mask=[1], reward=r)
                   for i, r in enumerate(rs)] for rs in ([0.5, 0.1, 0.9], [0.0, 1.0, 0.2])]
        rewards = [[t.reward for t in g] for g in groups]
        assert sample_advantages(groups, rewards, cfg.algo) == [[1.0, 0.0, 2.0], [0.0, 2.0, 1.0]]
    with pytest.raises(ConfigError, match="algo.name='rank' is not allowed"):
        load_config("tiny_cpu", ["algo.name=rank"])


def test_registered_reward_is_what_the_runner_calls():
    from reward_functions import length  # rewards run in worker processes: a module-level function

    with registered(REWARDS, "length", length):
        cfg = load_config("tiny_cpu", ["reward.name=length"])
        # As the trainer builds its runner: the verifier registered under reward.name.
        runner = RewardRunner(REWARDS[cfg.reward.name], cfg.reward.workers, cfg.reward.timeout_s)
        try:
            scores = asyncio.run(runner.score_many([("abc", "t1"), ("abcdefg", "t2")]))
        finally:
            runner.close()
    assert scores == [0.3, 0.7]
    with pytest.raises(ConfigError, match="reward.name='length' is not allowed"):
        load_config("tiny_cpu", ["reward.name=length"])


@pytest.mark.parametrize("weight_level", ["token", "sequence"])
def test_policy_loss_lookup_equals_the_functions(weight_level):
    gen = torch.Generator().manual_seed(0)
    b, s = 3, 6
    logprobs = (-torch.rand(b, s, generator=gen) * 2).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(b, s, generator=gen)
    behav = old + 0.3 * torch.randn(b, s, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, s)
    mask = (torch.rand(b, s, generator=gen) > 0.2).float()
    # Settings unlike the defaults and unlike each other, so a swapped argument shows.
    algo = replace(AlgoConfig(), clip_low=0.1, clip_high=0.3, dual_clip=3.0, behav_imp_weight_cap=1.5,
                   behav_weight_level=weight_level)
    direct = {
        "decoupled": lambda lp: decoupled_ppo_loss(lp, old, behav, adv, mask, 0.1, 0.3, 1.5, 3.0, weight_level),
        "ppo": lambda lp: ppo_clip_loss(lp, old, adv, mask, 0.1, 0.3, 3.0),
        "gspo": lambda lp: gspo_loss(lp, old, adv, mask, 0.1, 0.3),
        "cispo": lambda lp: cispo_loss(lp, old, adv, mask, 0.1, 0.3),
        "nll": lambda lp: (-adv * lp * mask, {"clipped_tokens": torch.tensor(0.0), "ratio_sum": mask.sum(),
                                              "approx_kl_sum": torch.tensor(0.0)}),
    }
    assert tuple(direct) == POLICY_LOSSES.names()
    for name, call in direct.items():
        loss, stats = POLICY_LOSSES.get(name)(logprobs, old, behav, adv, mask, algo)
        (grad,) = torch.autograd.grad(loss.sum(), logprobs)
        want_loss, want_stats = call(logprobs)
        (want_grad,) = torch.autograd.grad(want_loss.sum(), logprobs)
        assert torch.equal(loss, want_loss), name
        assert torch.equal(grad, want_grad), name
        assert stats.keys() == want_stats.keys(), name
        assert all(torch.equal(stats[k], want_stats[k]) for k in stats), name


def test_generate_groups_runs_the_named_workflow():
    seen = []

    async def echo(engine, prompt, params, request_ids):
        seen.append((engine, prompt, tuple(request_ids)))
        return list(request_ids)

    prompt = SimpleNamespace(uid="u7")
    with registered(WORKFLOWS, "echo", echo):
        groups = asyncio.run(generate_groups("engine", [(prompt, 2)], None, "s1", workflow="echo"))
    assert seen == [("engine", prompt, ("s1-u7-0", "s1-u7-1"))]
    assert groups == [["s1-u7-0", "s1-u7-1"]]


def test_trainer_runs_every_component_by_its_registered_name(megatron_world, tmp_path, monkeypatch):
    """One short run with each component registered under a new name that wraps a stock one: the
    trainer builds, rolls out, scores, estimates and trains through the names the config gives."""
    from megatron_rl.build import build_trainer
    from reward_functions import counted_digit_match  # rewards run in worker processes: counted in a file

    monkeypatch.setenv("REWARD_TEST_DIR", str(tmp_path))

    calls = Counter()

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    async def workflow(*args):
        calls["workflow"] += 1
        return await single_turn_group(*args)

    with registered(ENGINES, "test_engine", replace(ENGINES.get("embedded"), build=counted("engine", build_embedded))), \
            registered(WORKFLOWS, "test_workflow", workflow), \
            registered(REWARDS, "test_reward", counted_digit_match), \
            registered(ADVANTAGE_ESTIMATORS, "test_adv", counted("advantages", ADVANTAGE_ESTIMATORS.get("grpo"))), \
            registered(POLICY_LOSSES, "test_loss", counted("loss", POLICY_LOSSES.get("ppo"))):
        cfg = load_config("tiny_cpu", [
            "trainer.total_steps=2", f"trainer.run_dir={tmp_path}", "trainer.progress=false",
            "trainer.save_final_checkpoint=false", "algo.group_size=2", "algo.groups_per_batch=2",
            "learner.mini_batches=1", "rollout.engine=test_engine", "rollout.workflow=test_workflow",
            "reward.name=test_reward", "algo.name=test_adv", "algo.policy_loss=test_loss"])
        trainer = build_trainer(cfg)
        trainer.run()
    assert calls["engine"] == 1
    assert calls["workflow"] >= 4  # 2 steps x 2 groups (more if a prompt ran ahead)
    assert len((tmp_path / "calls").read_text().split()) >= 8  # every sample of those groups
    assert calls["advantages"] == 2 and calls["loss"] >= 2  # each batch, each micro-batch
