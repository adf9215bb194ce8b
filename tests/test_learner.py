"""The Megatron learner: the policy-gradient step moves logprobs the right way; checkpoints
restore model and optimizer exactly."""

import copy

import torch

from megatron_rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.config.schema import RootConfig
from megatron_rl.learner.learner import Learner
from megatron_rl.types import Trajectory

VOCAB = 24


def _batch():
    trajs = []
    for i in range(8):
        good = i % 2 == 0
        resp = [5, 6, 7] if good else [9, 10, 11]
        trajs.append(Trajectory("p", i, [1, 2, 3], resp, [-3.0] * 3, [0] * 3, "length",
                                advantage=1.0 if good else -1.0))
    return trajs


def _cfg():
    cfg = RootConfig()
    cfg.learner.lr = 1e-2
    return cfg


def test_train_step_raises_logprob_of_advantaged_tokens(megatron_world):
    learner = Learner(_cfg(), VOCAB)
    trajs = _batch()
    before = learner.compute_logprobs(trajs, 1.0)
    for _ in range(5):
        metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-2)
    after = learner.compute_logprobs(trajs, 1.0)
    assert sum(after[0]) > sum(before[0]) + 1.0  # positive advantage: more likely
    assert sum(after[1]) < sum(before[1]) - 1.0  # negative advantage: less likely
    for key in ("train/loss", "train/entropy", "train/clip_fraction", "train/grad_norm", "train/approx_kl"):
        assert key in metrics and metrics[key] == metrics[key]  # present and not NaN


def test_reference_kl_is_zero_at_start_and_grows(megatron_world):
    cfg = _cfg()
    cfg.algo.kl_coef = 0.1
    learner = Learner(cfg, VOCAB)
    first = learner.train_step(_batch(), 1.0, lr=1e-2)
    assert abs(first["train/kl"]) < 1e-6
    later = learner.train_step(_batch(), 1.0, lr=1e-2)
    assert later["train/kl"] > 1e-4


def test_checkpoint_roundtrip_restores_training_exactly(megatron_world, tmp_path):
    torch.manual_seed(0)
    a = Learner(_cfg(), VOCAB)
    a.train_step(_batch(), 1.0, lr=1e-2)  # optimizer state is non-trivial now
    save_checkpoint(a, tmp_path, step=1, trainer_state={"policy_version": 1})
    save_checkpoint(a, tmp_path, step=2, trainer_state={"policy_version": 2})
    save_checkpoint(a, tmp_path, step=3, trainer_state={"policy_version": 3}, keep=2)
    assert latest_checkpoint(tmp_path).name == "step_3"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3"]

    torch.manual_seed(1)
    b = Learner(_cfg(), VOCAB)  # different random init
    state = load_checkpoint(b, latest_checkpoint(tmp_path))
    assert state["policy_version"] == 3 and state["step"] == 3
    for (name, pa), (_, pb) in zip(a.module.state_dict().items(), b.module.state_dict().items()):
        if isinstance(pa, torch.Tensor):
            assert torch.equal(pa, pb), name
    ma = a.train_step(_batch(), 1.0, lr=1e-2)
    mb = b.train_step(_batch(), 1.0, lr=1e-2)
    assert ma["train/loss"] == mb["train/loss"]
    for (name, pa), (_, pb) in zip(a.module.state_dict().items(), b.module.state_dict().items()):
        if isinstance(pa, torch.Tensor):
            assert torch.equal(pa, pb), name  # same Adam moments -> same update
