"""LoRA on the Megatron learner (models/lora.py): the adapted model computes the base model with
merged fp32 weights; only the adapters train and only they are in the optimizer; the KL reference
is the base; checkpoints restore adapters and Adam state exactly (also at another layout); at TP=2
and PP=2 a step equals one process's; the config refuses what is not built."""

import copy

import pytest
import torch

from megatron_rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.checks import validate
from megatron_rl.config import ConfigError
from megatron_rl.learner.learner import Learner, forward_logits
from megatron_rl.models.hf_names import hf_to_megatron
from megatron_rl.models.lora import adapters_disabled, is_adapter_name

from parallel_cases import VOCAB, batch, tiny_cfg
from rank_harness import run_ranks

TOKENS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]])
RANK = 4


def lora_cfg(tp: int = 1, pp: int = 1, rank: int = RANK, dp_optimizer: bool = False):
    cfg = tiny_cfg(tp, pp, dp_optimizer=dp_optimizer)
    cfg.lora.rank, cfg.lora.alpha = rank, 8.0
    return cfg


def _perturb(module, seed: int = 7) -> None:
    """Every weight off its init, B included (B starts at zero, which would hide a wrong B·A)."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def _adapters(module):
    return {n: p for n, p in module.named_parameters() if is_adapter_name(n)}


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def test_adapted_model_starts_as_the_base_model(megatron_world):
    """B = 0: the LoRA learner's logits are the plain learner's (same seed, same base init: A is
    drawn from a generator of its own, so the base weights and the global random stream are untouched)."""
    plain = Learner(tiny_cfg(), VOCAB)
    lora = Learner(lora_cfg(), VOCAB)
    base = {k: v for k, v in _state(lora.module).items() if not is_adapter_name(k)}
    assert base.keys() == _state(plain.module).keys()
    assert all(torch.equal(v, _state(plain.module)[k]) for k, v in base.items())
    with torch.no_grad():
        assert torch.equal(forward_logits(lora.module, TOKENS), forward_logits(plain.module, TOKENS))


def test_logits_equal_the_base_model_with_merged_weights(megatron_world):
    """With nonzero B, the adapted model's logits equal a plain model loaded with the merged
    weights the engines receive (export_hf_weights: W + s·B·A in fp32, under HF names)."""
    lora = Learner(lora_cfg(), VOCAB)
    _perturb(lora.module)
    plain = Learner(tiny_cfg(), VOCAB)
    names = list(_state(plain.module))
    exported = dict(lora.export_hf_weights())
    assert not any("lora" in k for k in exported)
    assert exported.keys() == dict(plain.export_hf_weights()).keys()
    plain.module.load_state_dict(hf_to_megatron(exported, names, plain.cfg.model), strict=False)
    with torch.no_grad():
        adapted = forward_logits(lora.module, TOKENS)
        merged = forward_logits(plain.module, TOKENS)
        with adapters_disabled(lora.module):
            base = forward_logits(lora.module, TOKENS)
    gap = (adapted - merged).abs().max().item()
    print(f"adapted vs merged logits: {gap:.1e}; adapters' effect {(adapted - base).abs().max().item():.1e}")
    assert gap <= 1e-6
    assert (adapted - base).abs().max().item() > 1e-2  # the adapters matter here


def _adapter_numel(cfg, layers: int) -> int:
    m, r = cfg.model, cfg.lora.rank
    head = m.hidden_size // m.num_attention_heads
    qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * head
    per_layer = (r * m.hidden_size + qkv_out * r  # linear_qkv: A [r, h], B [q+k+v, r]
                 + r * m.num_attention_heads * head + m.hidden_size * r  # linear_proj
                 + r * m.hidden_size + 2 * m.ffn_hidden_size * r  # linear_fc1 (gate and up)
                 + r * m.ffn_hidden_size + m.hidden_size * r)  # linear_fc2
    return layers * per_layer


def test_only_the_adapters_train_and_the_optimizer_holds_only_them(megatron_world):
    cfg = lora_cfg()
    learner = Learner(cfg, VOCAB)
    adapters = _adapters(learner.module)
    assert len(adapters) == 2 * 4 * cfg.model.num_layers  # A and B of 4 projections per layer
    assert {n for n, p in learner.module.named_parameters() if p.requires_grad} == set(adapters)
    assert all(p.dtype == torch.float32 for p in adapters.values())
    in_optimizer = [p for g in learner.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in in_optimizer} == {id(p) for p in adapters.values()}
    expected = _adapter_numel(cfg, cfg.model.num_layers)
    assert sum(p.numel() for p in in_optimizer) == expected
    assert sum(b.grad_data.numel() for b in learner.model.buffers) == expected  # megatron's gradient buffers

    before = _state(learner.module)
    for _ in range(2):  # A's gradient is zero while B is: the second step moves A
        learner.train_step(copy.deepcopy(batch()), 1.0, lr=1e-3)
    after = _state(learner.module)
    for name, value in after.items():
        if is_adapter_name(name):
            assert not torch.equal(value, before[name]), name
        else:
            assert torch.equal(value, before[name]), name  # the base stays bit for bit
    opt_state = [s for s in learner.optimizer.optimizer.state.values()]
    assert len(opt_state) == len(adapters)


def test_activation_recompute_trains_the_adapters_the_same(megatron_world):
    """Under megatron's full recompute the first layers' adapters still get their gradients (the
    frozen embedding's output is made to require grad), and the step equals the one without."""
    results = []
    for recompute in (False, True):
        cfg = lora_cfg()
        cfg.learner.recompute_activations = recompute
        learner = Learner(cfg, VOCAB)
        _perturb(learner.module)
        learner.train_step(copy.deepcopy(batch()), 1.0, lr=1e-3)
        results.append({k: v for k, v in _state(learner.module).items() if is_adapter_name(k)})
    plain, recomputed = results
    assert "decoder.layers.0.self_attention.linear_qkv.lora_b" in recomputed
    for name in plain:
        assert (plain[name] - recomputed[name]).abs().max().item() <= 1e-6, name


def test_kl_reference_is_the_base_model_without_a_second_copy(megatron_world):
    cfg = lora_cfg()
    cfg.algo.kl_coef = 0.1
    learner = Learner(cfg, VOCAB)
    assert learner.ref_model is None
    trajs = batch()
    start = learner.compute_logprobs(trajs, 1.0)
    first = learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-2)
    assert abs(first["train/kl"]) < 1e-6
    later = learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-2)
    assert later["train/kl"] > 1e-5
    assert learner.compute_logprobs(trajs, 1.0, reference=True) == start
    assert learner.compute_logprobs(trajs, 1.0) != start


def test_adapter_dropout_applies_to_training_forwards_only(megatron_world):
    cfg = lora_cfg()
    cfg.lora.dropout = 0.5
    learner = Learner(cfg, VOCAB)
    _perturb(learner.module)
    trajs = batch()
    scored = learner.compute_logprobs(trajs, 1.0)
    assert learner.compute_logprobs(trajs, 1.0) == scored  # no dropout when scoring
    with torch.no_grad():
        assert not torch.equal(forward_logits(learner.module, TOKENS), forward_logits(learner.module, TOKENS))
    metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=1e-3)
    assert metrics["train/loss"] == metrics["train/loss"]


def _adam_state(learner):
    state = learner.optimizer.optimizer.state
    return [(state[p]["exp_avg"], state[p]["exp_avg_sq"]) for g in learner.optimizer.param_groups
            for p in g["params"]]


def test_checkpoint_roundtrip_restores_adapters_and_adam_state_exactly(megatron_world, tmp_path):
    a = Learner(lora_cfg(), VOCAB)
    for _ in range(2):
        a.train_step(copy.deepcopy(batch()), 1.0, lr=1e-3)
    save_checkpoint(a, tmp_path, step=2, trainer_state={})
    other = lora_cfg()
    other.trainer.seed = 99  # another base and other adapters until the load
    b = Learner(other, VOCAB)
    assert not torch.equal(_state(b.module)["decoder.layers.0.mlp.linear_fc1.lora_a"],
                           _state(a.module)["decoder.layers.0.mlp.linear_fc1.lora_a"])
    load_checkpoint(b, latest_checkpoint(tmp_path))
    sa, sb = _state(a.module), _state(b.module)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for (ma, va), (mb, vb) in zip(_adam_state(a), _adam_state(b)):
        assert torch.equal(ma, mb) and torch.equal(va, vb)
    assert len(_adam_state(b)) == len(_adapters(b.module))
    ra = a.train_step(copy.deepcopy(batch()), 1.0, lr=1e-3)
    rb = b.train_step(copy.deepcopy(batch()), 1.0, lr=1e-3)
    assert ra["train/loss"] == rb["train/loss"]
    sa, sb = _state(a.module), _state(b.module)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # same Adam moments, same update


def test_bf16_base_with_fp32_adapters(megatron_world):
    """model.dtype=bf16: the base stays bf16 and frozen, the adapters fp32 and trained (megatron's
    mixed-precision optimizer keeps fp32 parameters as they are), the merged export is bf16."""
    cfg = lora_cfg()
    cfg.model.dtype = "bf16"
    learner = Learner(cfg, VOCAB)
    before = _state(learner.module)
    for _ in range(2):
        learner.train_step(copy.deepcopy(batch()), 1.0, lr=1e-3)
    for name, value in _state(learner.module).items():
        if is_adapter_name(name):
            assert value.dtype == torch.float32 and not torch.equal(value, before[name]), name
        else:
            assert value.dtype == torch.bfloat16 and torch.equal(value, before[name]), name
    assert {t.dtype for _, t in learner.export_hf_weights()} == {torch.bfloat16}


# ---------------------------------------------------------------- TP = 2, PP = 2 and DP = 2 worlds
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(megatron_world):
    learner = Learner(lora_cfg(), VOCAB)
    _perturb(learner.module)
    full = _state(learner.module)
    trajs = batch()
    logprobs = learner.compute_logprobs(trajs, 1.0)
    learner.train_step(copy.deepcopy(trajs), 1.0, lr=learner.cfg.learner.lr)
    from megatron_rl.weights.reshard import full_tensors

    merged = dict(full_tensors(learner.module, merged=True))
    return full, trajs, logprobs, _state(learner.module), merged


def _gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("tp, pp, dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2-distopt"])
def test_sharded_lora_learner_equals_single_process(reference, tp, pp, dp):
    """Each rank loads the reference's full weights (adapters split: column-parallel B by rows,
    gate/up halves kept apart; row-parallel A by columns), scores, trains one step: logprobs,
    updated adapters (hence their gradients), merged export and adapter export equal one process's.
    DP=2 with the distributed optimizer: the frozen base stays out of its sharded buffers."""
    from parallel_cases import learner_case

    full, trajs, ref_lp, ref_updated, ref_merged = reference
    cfg = lora_cfg(tp, pp, dp_optimizer=dp > 1)
    out = run_ranks(learner_case, tp * pp * dp, args=(cfg, full, trajs), timeout_s=180)
    weights, merged, adapters = {}, {}, {}
    for o in out:
        weights.update(o["weights"]), merged.update(o["merged"]), adapters.update(o["adapters"])
        assert o["roundtrip_max_err"] == 0.0
        assert _gap(o["logprobs"], ref_lp) <= TOL
        assert all(is_adapter_name(n) for n in o["trainable"])
        if dp == 1:  # (the distributed optimizer holds each replica's share of them)
            assert o["optimizer_numel"] == o["trainable_numel"]
    if dp > 1:  # each replica's optimizer holds its shard of the adapters: together, all of them
        assert sum(o["optimizer_numel"] for o in out) == out[0]["trainable_numel"]
    assert weights.keys() == ref_updated.keys()
    worst = max((weights[k] - ref_updated[k]).abs().max().item() for k in weights)
    moved = max((ref_updated[k] - full[k]).abs().max().item() for k in full if is_adapter_name(k))
    print(f"tp={tp} pp={pp} dp={dp}: logprob gap {max(_gap(o['logprobs'], ref_lp) for o in out):.1e}, "
          f"updated weight gap {worst:.1e} (adapters moved {moved:.1e})")
    assert moved > 5e-5 and worst <= TOL
    for k in weights:
        if not is_adapter_name(k):
            assert torch.equal(weights[k], full[k]), k  # the base is frozen on every rank
    assert merged.keys() == ref_merged.keys()
    assert max((merged[k] - ref_merged[k]).abs().max().item() for k in merged) <= TOL
    assert adapters.keys() == {k for k in ref_updated if is_adapter_name(k)}
    assert all(torch.equal(adapters[k], weights[k]) for k in adapters)
    if tp == 2:  # each rank holds half of a column-parallel B and of a row-parallel A: less than the whole
        assert out[0]["trainable_numel"] < _adapter_numel(lora_cfg(), 4)


def test_checkpoint_written_in_one_process_resumes_at_tensor_parallel_two(megatron_world, tmp_path):
    """A single-process LoRA checkpoint (adapters and Adam state) reloads at TP=2, split along each
    adapter's own axis, and the next step there equals the single process's next step."""
    from parallel_cases import resumed_step_case

    a = Learner(lora_cfg(), VOCAB)
    _perturb(a.module)
    a.train_step(copy.deepcopy(batch()), 1.0, lr=a.cfg.learner.lr)
    path = save_checkpoint(a, tmp_path, step=1, trainer_state={})
    expected_metrics = a.train_step(copy.deepcopy(batch()), 1.0, lr=a.cfg.learner.lr)
    expected = _state(a.module)
    out = run_ranks(resumed_step_case, 2, args=(lora_cfg(tp=2), str(path), batch()), timeout_s=180)
    weights = out[0]["weights"]
    assert weights.keys() == expected.keys()
    worst = max((weights[k] - expected[k]).abs().max().item() for k in weights)
    print(f"resumed at tp=2: weight gap {worst:.1e}")
    assert worst <= TOL
    assert abs(out[0]["metrics"]["train/loss"] - expected_metrics["train/loss"]) <= TOL


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, words", [
    ({"lora.rank": -1}, "lora.rank=-1"),
    ({"lora.alpha": 0.0}, "lora.alpha=0.0"),
    ({"lora.dropout": 1.0}, "lora.dropout=1.0"),
    ({"lora.targets": ["linear_qkv", "q_proj"]}, "lora.targets="),
    ({"lora.targets": []}, "lora.targets="),
    ({"lora.sync": "files"}, "lora.sync"),
    ({"model.family": "mixtral", "model.num_experts": 4}, "routed experts"),
    ({"lora.targets": ["linear_qkv"], "model.kv_lora_rank": 16}, "multi-head latent attention"),
])
def test_config_refuses_what_lora_cannot_do(tiny_cfg, overrides, words):
    tiny_cfg.lora.rank = 8
    for key, value in overrides.items():
        group, name = key.split(".")
        setattr(getattr(tiny_cfg, group), name, value)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(".", r"\.")):
        validate(tiny_cfg)


def test_config_accepts_lora_on_attention_of_an_moe_model(tiny_cfg):
    tiny_cfg.lora.rank = 8
    tiny_cfg.lora.targets = ["linear_qkv", "linear_proj"]
    tiny_cfg.model.family, tiny_cfg.model.num_experts = "mixtral", 4
    validate(tiny_cfg)


def test_a_lora_checkpoint_does_not_load_as_a_plain_model(megatron_world, tmp_path):
    """model.path at a LoRA run's checkpoint would load the base and drop the adapters: refused."""
    from megatron_rl.models.convert import load_megatron_weights
    from megatron_rl.models.hf_checkpoint import ConversionError

    lora = Learner(lora_cfg(), VOCAB)
    path = save_checkpoint(lora, tmp_path, step=1, trainer_state={})
    plain = Learner(tiny_cfg(), VOCAB)
    with pytest.raises(ConversionError, match="LoRA run's checkpoint"):
        load_megatron_weights(plain.module, path)


def test_critic_starts_from_the_lora_policys_merged_weights(megatron_world):
    """PPO's critic (algo.name=gae) copies the policy's trunk: a LoRA policy's merged weights, no
    adapters; the critic trains all of its own weights."""
    from megatron_rl.learner.critic import Critic

    cfg = lora_cfg()
    policy = Learner(cfg, VOCAB)
    _perturb(policy.module)
    critic = Critic(cfg, VOCAB, policy=policy.module)
    assert not any(is_adapter_name(n) for n in critic.module.state_dict())
    assert all(p.requires_grad for p in critic.module.parameters())
    merged = dict(policy.export_hf_weights())
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    from megatron_rl.models.hf_names import megatron_to_hf

    for hf_name, tensor in megatron_to_hf(qkv, critic.module.state_dict()[qkv], cfg.model):
        assert torch.equal(tensor, merged[hf_name]), hf_name
