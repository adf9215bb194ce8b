"""PPO's critic: a Megatron value model that starts from the policy's trunk, predicts one value
per response token, regresses on GAE returns, and is checkpointed with the policy."""

import copy

import pytest
import torch

from megatron_rl.algorithms import gae_advantages, masked_whiten
from megatron_rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.config.schema import RootConfig
from megatron_rl.learner.critic import Critic
from megatron_rl.learner.recipes import gae_advantages_and_returns
from megatron_rl.learner.learner import Learner
from megatron_rl.learner.train_batch import TrainBatch
from megatron_rl.types import Trajectory

from batches import gae_batch

VOCAB = 24


def _cfg(**critic):
    cfg = RootConfig()
    cfg.algo.name = "gae"
    cfg.learner.lr = 1e-2
    for k, v in critic.items():
        setattr(cfg.critic, k, v)
    return cfg


def _batch():
    """Two kinds of responses of different lengths; the good kind is rewarded."""
    trajs = []
    for i in range(8):
        good = i % 2 == 0
        resp = [5, 6, 7] if good else [9, 10, 11, 12, 13]
        trajs.append(Trajectory("p", i, [1, 2, 3], resp, [-3.0] * len(resp), [0] * len(resp), "stop",
                                reward=1.0 if good else 0.0))
    return trajs


def test_critic_starts_from_the_policy_trunk_with_zero_values(megatron_world):
    learner = Learner(_cfg(), VOCAB)
    critic = Critic(_cfg(), VOCAB, policy=learner.module)
    policy_state = learner.module.state_dict()
    for name, tensor in critic.module.state_dict().items():
        if name.startswith("output_layer.") or not isinstance(tensor, torch.Tensor):
            continue
        assert torch.equal(tensor, policy_state[name]), name
    values = critic.compute_values(_batch())
    assert [len(v) for v in values] == [3, 5] * 4  # one value per response token
    assert all(v == 0.0 for row in values for v in row)


def test_critic_regresses_on_returns(megatron_world):
    cfg = _cfg(value_clip=0.0)
    critic = Critic(cfg, VOCAB)
    trajs = _batch()
    losses = []
    for _ in range(30):
        losses.append(critic.train_step(gae_batch(critic, trajs, gamma=1.0, lam=1.0))["critic/value_loss"])
    values = critic.compute_values(trajs)
    # γ = λ = 1: every token's return is the outcome reward. Past the first response token the
    # critic sees which kind of response it is in; at the first it sees only the (shared) prompt,
    # so the best it can do is the mean return 0.5, an irreducible loss of ½·0.25 on 8 of the 32
    # tokens = 0.03125.
    assert losses[0] > 0.15 and losses[-1] < 0.04, losses
    assert min(values[0][1:]) > 0.8 and max(values[1][1:]) < 0.2, values[:2]
    assert values[0][0] == pytest.approx(0.5, abs=0.1) and values[1][0] == pytest.approx(values[0][0])


def test_value_clip_holds_values_near_the_old_ones_across_epochs(megatron_world):
    def first_response_values_after(clip):
        torch.manual_seed(0)
        cfg = _cfg(value_clip=clip)
        cfg.learner.ppo_epochs = 5  # the clip acts from the second optimizer step on the batch
        critic = Critic(cfg, VOCAB)
        trajs = _batch()
        metrics = critic.train_step(gae_batch(critic, trajs, 1.0, 1.0))
        return critic.compute_values(trajs)[0][1:], metrics

    free, free_metrics = first_response_values_after(0.0)
    clipped, metrics = first_response_values_after(0.01)
    assert free_metrics["critic/value_clip_fraction"] == 0.0 and metrics["critic/value_clip_fraction"] > 0.1
    # Towards a return of 1 from 0: the first step (lr 1e-2) moves both critics alike; from then on
    # the clipped one has passed old + 0.01 and stops, the free one goes on to ~0.9.
    assert max(clipped) < 0.15 and min(free) > 0.5, (free, clipped)


def test_gae_assignment_matches_the_pure_function():
    trajs = _batch()
    given = [[0.1 * (i + k) for k in range(len(t.response_ids))] for i, t in enumerate(trajs)]
    batch = TrainBatch.of(trajs, rewards=[t.reward for t in trajs], values=given)
    got_adv, got_ret = gae_advantages_and_returns(batch, gamma=0.9, lam=0.8, whiten=False)
    rewards = torch.zeros(8, 5, dtype=torch.float64)
    values = torch.zeros(8, 5, dtype=torch.float64)
    valid = torch.zeros(8, 5, dtype=torch.float64)
    for i, t in enumerate(trajs):
        n = len(t.response_ids)
        rewards[i, n - 1] = t.reward
        values[i, :n] = torch.tensor(given[i], dtype=torch.float64)
        valid[i, :n] = 1
    adv, ret = gae_advantages(rewards, values, valid, 0.9, 0.8)
    for i, t in enumerate(trajs):
        n = len(t.response_ids)
        assert got_adv[i] == pytest.approx(adv[i, :n].tolist())
        assert got_ret[i] == pytest.approx(ret[i, :n].tolist())
    white_adv, _ = gae_advantages_and_returns(batch, gamma=0.9, lam=0.8, whiten=True)
    white = masked_whiten(adv, valid)
    assert white_adv[1] == pytest.approx(white[1, :5].tolist())


def test_policy_trains_on_per_token_advantages(megatron_world):
    learner = Learner(_cfg(), VOCAB)
    # Only the first token of each response carries the signal.
    trajs = TrainBatch.of(_batch(), advantages=[[1.0 if t.reward else -1.0] + [0.0] * (len(t.response_ids) - 1)
                                                for t in _batch()])
    before = learner.compute_logprobs(trajs, 1.0)
    for _ in range(5):
        learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-2)
    after = learner.compute_logprobs(trajs, 1.0)
    assert after[0][0] > before[0][0] + 0.5 and after[1][0] < before[1][0] - 0.5


def test_checkpoint_holds_the_critic(megatron_world, tmp_path):
    cfg = _cfg()
    torch.manual_seed(0)
    learner, critic = Learner(cfg, VOCAB), Critic(cfg, VOCAB)
    trajs = gae_batch(critic, _batch(), 1.0, 1.0)
    critic.train_step(copy.deepcopy(trajs))  # Adam moments are non-trivial now
    learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-2)
    save_checkpoint(learner, tmp_path, step=1, trainer_state={}, critic=critic)

    torch.manual_seed(1)
    learner2, critic2 = Learner(cfg, VOCAB), Critic(cfg, VOCAB)
    load_checkpoint(learner2, latest_checkpoint(tmp_path), critic=critic2)
    assert critic2.compute_values(trajs) == critic.compute_values(trajs)
    a = critic.train_step(copy.deepcopy(trajs))
    b = critic2.train_step(copy.deepcopy(trajs))
    assert a["critic/value_loss"] == b["critic/value_loss"]
    assert critic2.compute_values(trajs) == critic.compute_values(trajs)  # same Adam state, same update
