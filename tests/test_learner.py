"""The Megatron learner: the policy-gradient step moves logprobs the right way; checkpoints
restore model and optimizer exactly."""

import copy

import pytest
import torch

from megatron_rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.config.schema import RootConfig
from megatron_rl.learner.learner import Learner
from megatron_rl.types import Trajectory

from batches import advantaged

VOCAB = 24


def _batch():
    trajs = []
    for i in range(8):
        resp = [5, 6, 7] if i % 2 == 0 else [9, 10, 11]
        trajs.append(Trajectory("p", i, [1, 2, 3], resp, [-3.0] * 3, [0] * 3, "length"))
    return advantaged(trajs, [1.0 if i % 2 == 0 else -1.0 for i in range(8)])


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


def _long_tailed_batch():
    """Responses of 1..40 tokens: most short, a few long."""
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for i, n in enumerate([1, 2, 2, 3, 3, 3, 4, 5, 6, 9, 17, 40]):
        resp = torch.randint(4, VOCAB, (n,), generator=gen).tolist()
        trajs.append(Trajectory("p", i, [1, 2 + i % 3, 3], resp, [-2.5] * n, [0] * n, "stop"))
    return advantaged(trajs, [float(i % 3 - 1) for i in range(len(trajs))])


def test_length_packing_changes_nothing_but_padding(megatron_world, monkeypatch):
    """Packing a long-tailed batch by length (several micro-batches, each padded to its own
    longest) gives the same logprobs, loss and updated weights as equal-shape packing."""
    import megatron_rl.learner.megatron_step as megatron_step
    from megatron_rl.learner.batch import build_micro_batches

    trajs = _long_tailed_batch()
    by_length = build_micro_batches(trajs, 64, equal_shape=False)
    equal = build_micro_batches(trajs, 64, equal_shape=True)
    assert sorted(i for mb in by_length for i in mb.rows) == list(range(len(trajs)))
    assert all(mb.tokens.numel() <= 64 or mb.tokens.shape[0] == 1 for mb in by_length)
    padded = sum(mb.tokens.numel() for mb in by_length)
    assert padded * 2 < sum(mb.tokens.numel() for mb in equal)  # the point of it

    results = []
    for equal_shape in (False, True):
        cfg = _cfg()
        cfg.learner.micro_batch_tokens = 64
        learner = Learner(cfg, VOCAB)
        # The learner packs by length without a pipeline; here it packs as told, and says how.
        shapes = []

        def packing(ts, budget, pad_id, equal_shape=False, overhead_tokens=0, eq=equal_shape):
            mbs = build_micro_batches(ts, budget, pad_id, equal_shape=eq, overhead_tokens=overhead_tokens)
            shapes.append(len({mb.tokens.shape for mb in mbs}))
            return mbs

        monkeypatch.setattr(megatron_step, "build_micro_batches", packing)
        logprobs = learner.compute_logprobs(trajs, 1.0)
        # (Adam's first step is ~lr·sign(g), which magnifies rounding in near-zero gradients:
        # 1.9e-5 at lr 1e-3.)
        metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-4)
        weights = [p.detach().clone() for p in learner.model.parameters()]
        assert shapes and all((n == 1) == equal_shape for n in shapes)  # the packing under test ran
        results.append((logprobs, metrics, weights))
    (lp_a, m_a, w_a), (lp_b, m_b, w_b) = results
    assert max(abs(x - y) for ra, rb in zip(lp_a, lp_b) for x, y in zip(ra, rb)) <= 1e-6
    assert abs(m_a["train/loss"] - m_b["train/loss"]) <= 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(w_a, w_b)) <= 1e-5


def test_single_step_batches_take_proximal_logprobs_from_the_training_forward(megatron_world):
    """With one optimizer step per batch the separate proximal forward is skipped; the loss,
    statistics and updated weights equal the explicit two-pass computation (both losses, with
    behaviour logprobs that differ from the policy's, as for stale samples)."""
    for policy_loss in ("ppo", "decoupled"):
        results = []
        for force in (False, True):
            cfg = _cfg()
            cfg.algo.policy_loss = policy_loss
            learner = Learner(cfg, VOCAB)
            learner.force_proximal_forward = force
            metrics = learner.train_step(copy.deepcopy(_long_tailed_batch()), 1.0, lr=1e-3)
            results.append((metrics, [p.detach().clone() for p in learner.model.parameters()]))
        (m_fused, w_fused), (m_two, w_two) = results
        for key in ("train/loss", "train/clip_fraction", "train/behav_logprob_gap", "train/entropy"):
            assert abs(m_fused[key] - m_two[key]) <= 1e-6, (policy_loss, key, m_fused[key], m_two[key])
        assert max((a - b).abs().max().item() for a, b in zip(w_fused, w_two)) <= 1e-5


def test_loss_aggregation_modes_add_up_over_micro_batches(megatron_world):
    """Through Megatron's schedule (which divides the summed gradients by the summed
    denominators), each aggregation gives the same gradient whether the batch is one micro-batch
    or several of different lengths."""
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        results = []
        for budget in (16, 4096):  # several micro-batches vs one
            cfg = _cfg()
            cfg.algo.loss_agg_mode = mode
            cfg.learner.micro_batch_tokens = budget
            learner = Learner(cfg, VOCAB)
            learner.train_step(copy.deepcopy(_long_tailed_batch()), 1.0, lr=1e-3)
            results.append([p.main_grad.detach().clone() for p in learner.model.parameters()])
        scale = max(g.abs().max().item() for g in results[1])
        assert max((a - b).abs().max().item() for a, b in zip(*results)) <= 1e-5 * scale, mode


def test_kl_in_reward_charges_sequences_not_the_loss(megatron_world, tmp_path):
    """algo.kl_in_reward through the trainer: the charge is 0 while the policy is the reference
    and grows as it moves (the loss side is checked in the next test)."""
    import json

    from megatron_rl.checks import load_config
    from megatron_rl.build import build_trainer

    cfg = load_config("tiny_cpu", [
        "trainer.total_steps=6", f"trainer.run_dir={tmp_path}", "trainer.progress=false",
        "trainer.save_final_checkpoint=false", "algo.groups_per_batch=4", "algo.group_size=4",
        "learner.mini_batches=2", "algo.kl_coef=0.05", "algo.kl_in_reward=true", "scheduler.max_staleness=0"])
    build_trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    charges = [r["reward/kl_penalty_mean"] for r in rows]
    assert charges[0] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert all(c >= 0 for c in charges) and charges[-1] > 0  # k3 is non-negative; it grew
    assert all(r["train/kl"] >= 0 for r in rows)


def test_kl_term_leaves_the_loss_when_it_is_in_the_reward(megatron_world):
    results = {}
    for in_reward in (False, True):
        cfg = _cfg()
        cfg.algo.kl_coef, cfg.algo.kl_in_reward = 0.1, in_reward
        learner = Learner(cfg, VOCAB)
        # A reference that disagrees with the policy, so the KL is not zero.
        trajs = _batch().with_fields(ref_logprobs=[[-0.5] * len(t.response_ids) for t in _batch()])
        results[in_reward] = learner.train_step(trajs, 1.0, lr=1e-3)
    with_kl, without = results[False], results[True]
    assert with_kl["train/kl"] == pytest.approx(without["train/kl"]) and with_kl["train/kl"] > 0.1
    assert with_kl["train/loss"] - without["train/loss"] == pytest.approx(0.1 * with_kl["train/kl"], rel=1e-5)


def test_micro_batch_layout_by_hand():
    """Tokens right-padded, labels shifted by one, each per-token field at the positions whose
    logits predict the response tokens; filler rows empty; a field of the wrong length is an error."""
    import pytest

    from megatron_rl.learner.batch import build_micro_batches
    from megatron_rl.types import Trajectory

    a = Trajectory("a", 0, [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0, 0, 0], "stop")
    b = Trajectory("b", 1, [6, 7, 8], [9], [-0.5], [0], "stop")
    # Within the budget the batch is trained at its own size: no filler rows.
    (mb,) = build_micro_batches(advantaged([a, b], [1.5, -2.0]), token_budget=15, pad_id=0)
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert mb.labels.tolist() == [[2, 3, 4, 5, 0], [7, 8, 9, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]
    assert mb.advantages.tolist() == [[0, 1.5, 1.5, 1.5, 0], [0, 0, -2.0, 0, 0]]
    assert torch.allclose(mb.behav_logprobs, torch.tensor([[0, -0.1, -0.2, -0.3, 0], [0, 0, -0.5, 0, 0]]))
    assert mb.rows == [0, 1]
    # Several micro-batches of one shape: rows spread evenly, the last one's filler row empty.
    c = Trajectory("c", 2, [5], [6], [-0.7], [0], "stop")
    first, second = build_micro_batches([a, b, c], token_budget=10, pad_id=0)
    assert first.rows == [0, 1] and second.rows == [2, -1]
    assert second.tokens.tolist() == [[5, 6, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert second.loss_mask.tolist() == [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    # Five rows at four a micro-batch: 3 + 3 (one filler), not 4 + 4 (three).
    five = [Trajectory(f"r{i}", i, [1], [2], [-0.1], [0], "stop") for i in range(5)]
    assert [mb.rows for mb in build_micro_batches(five, token_budget=8)] == [[0, 1, 2], [3, 4, -1]]
    b = Trajectory("b", 1, [6, 7, 8], [9], [-0.5], [0], "stop")
    b.logprobs = [-0.5, -0.6]
    with pytest.raises(ValueError, match="b/1: behav_logprobs has 2 values for 1 response tokens"):
        build_micro_batches([a, b], token_budget=15)


def test_split_by_length_trades_padding_against_micro_batches():
    from megatron_rl.learner.batch import split_by_length

    lengths = [2] * 6 + [3] * 6 + [10] * 2 + [40]
    # Free micro-batches: one per distinct length, no padding at all.
    assert split_by_length(lengths, 1000, overhead_tokens=0) == [list(range(6)), list(range(6, 12)),
                                                                 [12, 13], [14]]
    # Costly ones: the short rows share one micro-batch (padded to 3: 6 tokens more than apart).
    assert split_by_length(lengths, 1000, overhead_tokens=50) == [list(range(12)), [12, 13], [14]]
    # Prohibitive ones: everything in one, as far as the token budget allows.
    assert split_by_length(lengths, 1000, overhead_tokens=10**6) == [list(range(15))]
    # Over the budget a run is cut into equal parts, never a part of one row padded alone.
    assert split_by_length([5] * 10, 20, overhead_tokens=0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert split_by_length([5] * 9, 20, overhead_tokens=0) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # A sequence longer than the budget goes alone.
    assert split_by_length([3, 3, 50], 20, overhead_tokens=10**6) == [[0, 1], [2]]
    # Thousands of distinct lengths (long contexts): the search keeps a bounded set of cut points.
    many = list(range(1, 3001))
    groups = split_by_length(many, 6000, 100)
    assert [i for g in groups for i in g] == list(range(len(many)))
    assert all(len(g) * many[g[-1]] <= 6000 or len(g) == 1 for g in groups)
    for budget, overhead in ((7, 0), (64, 16), (1000, 300)):
        groups = split_by_length(sorted(lengths), budget, overhead)
        assert [i for g in groups for i in g] == list(range(len(lengths)))
        assert all(len(g) * lengths[g[-1]] <= budget or len(g) == 1 for g in groups)


def test_micro_batch_overhead_defaults_by_device_and_can_be_set():
    """learner.micro_batch_overhead_tokens unset: the device's measured default (CPU here, where
    the batch below splits); set: what it says (prohibitive: one micro-batch; free: one per length)."""
    from megatron_rl.config.schema import LearnerConfig
    from megatron_rl.learner.megatron_step import micro_batches

    from megatron_rl.learner.batch import MICRO_BATCH_OVERHEAD_TOKENS

    trajs = _long_tailed_batch()
    lc = LearnerConfig(micro_batch_tokens=1000)
    assert lc.micro_batch_overhead_tokens is None
    by_default = micro_batches(trajs, lc, 0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lc.micro_batch_overhead_tokens = MICRO_BATCH_OVERHEAD_TOKENS[device]
    assert [mb.rows for mb in micro_batches(trajs, lc, 0)] == [mb.rows for mb in by_default]
    assert len(by_default) > 1 or device == "cuda"  # on a CPU the default splits this batch
    lc.micro_batch_overhead_tokens = 10**9
    assert len(micro_batches(trajs, lc, 0)) == 1
    lc.micro_batch_overhead_tokens = 0
    assert len(micro_batches(trajs, lc, 0)) == len({len(t.prompt_ids) + len(t.response_ids) for t in trajs})


def test_fused_adam_step_equals_the_default_one(megatron_world):
    """The learner's GPU path switches torch's Adam (megatron-core's fallback without TE/apex) to
    its fused kernel; the update must be the same (torch has a fused Adam on the CPU too)."""
    from megatron_rl.learner.megatron_step import use_fused_adam

    torch.manual_seed(0)
    plain = Learner(_cfg(), VOCAB)
    fused = Learner(_cfg(), VOCAB)
    fused.module.load_state_dict(plain.module.state_dict())
    assert use_fused_adam(fused.optimizer) == 1
    assert all(g["fused"] for g in fused.optimizer.optimizer.param_groups)
    start = {k: v.clone() for k, v in plain.module.state_dict().items() if isinstance(v, torch.Tensor)}
    for learner in (plain, fused):
        for _ in range(2):
            learner.train_step(copy.deepcopy(_batch()), 1.0, lr=1e-2)
    a, b = plain.module.state_dict(), fused.module.state_dict()
    assert max((a[k] - start[k]).abs().max() for k in start) > 1e-3  # the steps moved the weights
    for k in a:
        if isinstance(a[k], torch.Tensor):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_activation_recompute_trains_the_same(megatron_world, monkeypatch):
    """learner.recompute_activations: the backward recomputes each layer's activations; the
    step's loss and updated weights are those without it."""
    from megatron.core import tensor_parallel

    checkpoint, calls = tensor_parallel.checkpoint, []
    monkeypatch.setattr(tensor_parallel, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    torch.manual_seed(0)
    plain = Learner(_cfg(), VOCAB)
    cfg = _cfg()
    cfg.learner.recompute_activations = True
    again = Learner(cfg, VOCAB)
    assert again.module.config.recompute_granularity == "full"
    again.module.load_state_dict(plain.module.state_dict())
    a = plain.train_step(copy.deepcopy(_batch()), 1.0, lr=1e-2)
    assert not calls
    b = again.train_step(copy.deepcopy(_batch()), 1.0, lr=1e-2)
    assert len(calls) == again.module.config.num_layers  # one checkpoint per layer
    assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6, abs=1e-7)
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    sa, sb = plain.module.state_dict(), again.module.state_dict()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank, logged", [(0, True), (1, False)])
def test_saved_checkpoint_is_logged_by_the_first_learner_rank_only(monkeypatch, tmp_path, caplog, rank, logged):
    """Every learner rank writes its shards; "saved checkpoint" is one line, from rank 0."""
    import logging

    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint import save as save_module

    monkeypatch.setattr(save_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(save_module.dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(save_module.dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(save_module, "_sharded_state", lambda learner, critic=None: {})
    monkeypatch.setattr(dist_checkpointing, "save", lambda state, path: None)
    if rank:  # rank 0 made the directory the shards go to
        (tmp_path / ".step_1.tmp").mkdir()
    with caplog.at_level(logging.INFO, logger=save_module.__name__):
        save_checkpoint(None, tmp_path, step=1, trainer_state={})
    assert ("saved checkpoint" in caplog.text) == logged


def test_start_and_resume_print_none_of_the_known_noise_warnings():
    """Importing megatron-core, building and training a model, saving and resuming: none of the
    TransformerEngine/Apex fallback, "full scope is deprecated" or ShardedTensor warnings."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "start_and_resume_warnings.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([sys.executable, "-W", "always::UserWarning", "-W", "always::FutureWarning", str(script)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "resumed" in out.stderr, out.stderr[-3000:]
    for noise in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                  "full scope is deprecated", "deprecating ShardedTensor", "`load_state_dict` is deprecated"):
        assert noise not in out.stderr, noise
