"""Grouped experts (models/grouped_moe.py) against megatron-core's SequentialMLP loop, and routing
record / replay (models/routing.py): fp32, forward and gradients, one process and EP=2 on gloo."""

import pytest
import torch

from megatron_rl.config.schema import ModelConfig

from rank_harness import run_ranks

TOL = 1e-6
VOCAB = 64

# One config per router arithmetic the families use: renormalised top-k softmax (Qwen3-MoE,
# Mixtral), softmax over all experts then top-k with a gated shared expert (Qwen2-MoE), and
# DeepSeek-V3's sigmoid scores with a choice-only bias, expert groups and a scaling factor.
ROUTERS = {
    "qwen3_moe": dict(family="qwen3_moe"),
    "qwen2_moe": dict(family="qwen2_moe", moe_norm_topk_prob=False, moe_shared_expert_ffn_hidden_size=40,
                      moe_shared_expert_gate=True),
    "sigmoid_groups": dict(family="qwen3_moe", num_experts=8, moe_router_score_function="sigmoid",
                           moe_router_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
                           moe_router_topk_scaling_factor=2.5),
}


def _cfg(grouped: bool, **kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_grouped_experts=grouped)
    base.update(kw)
    return ModelConfig(**base)


def _twin_models(**kw):
    """A SequentialMLP model and a grouped one with the same weights (moved off init)."""
    from megatron_rl.models.gpt import build_gpt_model

    torch.manual_seed(0)
    sequential = build_gpt_model(_cfg(False, **kw), vocab_size=VOCAB)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in sequential.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
        for name, buf in sequential.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    grouped = build_gpt_model(_cfg(True, **kw), vocab_size=VOCAB)
    grouped.load_state_dict(sequential.state_dict())
    return sequential, grouped


def _logits_and_grads(model, tokens):
    from megatron_rl.learner.learner import forward_logits

    model.zero_grad(set_to_none=True)
    logits = forward_logits(model.train(), tokens)
    # A loss whose gradient is not uniform (an all-ones gradient hides layout mistakes).
    weights = torch.linspace(-1, 1, logits.numel()).view_as(logits)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grouped_linear_equals_a_loop_forward_and_backward_with_an_empty_expert():
    from megatron_rl.models.grouped_moe import grouped_linear

    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1]
    x = torch.randn(sum(counts), 16, generator=gen, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=gen, requires_grad=True)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = grouped_linear(x, w, ends)
    ref = torch.cat([chunk @ w[e].t() for e, chunk in enumerate(torch.split(x, counts))])
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    grad = torch.randn(out.shape, generator=gen)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    rx, rw = torch.autograd.grad(ref, (x, w), grad)
    torch.testing.assert_close(gx, rx, atol=TOL, rtol=0)
    torch.testing.assert_close(gw, rw, atol=TOL, rtol=0)
    assert gw[1].abs().max() == 0  # the expert with no rows
    # An expanded incoming gradient (what .sum() sends back) works too.
    grouped_linear(x, w, ends).sum().backward()


def test_counting_and_radix_sorts_by_expert_give_the_same_permutation(monkeypatch):
    from megatron_rl.models import grouped_moe

    gen = torch.Generator().manual_seed(3)
    experts = torch.randint(0, 16, (300,), generator=gen)
    experts[experts == 5] = 6  # an expert with no rows
    counts = torch.bincount(experts, minlength=16).to(torch.int32)
    ends = counts.cumsum(0, dtype=torch.int32)
    counted = grouped_moe.rows_by_expert(experts, counts, ends)
    monkeypatch.setattr(grouped_moe, "COUNTING_SORT_MAX", 0)
    sorted_ = grouped_moe.rows_by_expert(experts, counts, ends)
    assert torch.equal(counted[0], torch.argsort(experts, stable=True))
    assert torch.equal(counted[0], sorted_[0]) and torch.equal(counted[1], sorted_[1])
    assert torch.equal(counted[0][counted[1]], torch.arange(300))


@pytest.mark.parametrize("router", list(ROUTERS))
def test_grouped_experts_equal_sequential_mlp_forward_and_gradients(megatron_world, router):
    from megatron_rl.models.grouped_moe import GroupedExperts, GroupedMoELayer

    sequential, grouped = _twin_models(**ROUTERS[router])
    layer = grouped.decoder.layers[0].mlp
    assert isinstance(layer, GroupedMoELayer) and isinstance(layer.experts, GroupedExperts) and layer.on_device_path()
    tokens = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    seq_logits, seq_grads = _logits_and_grads(sequential, tokens)
    grp_logits, grp_grads = _logits_and_grads(grouped, tokens)
    torch.testing.assert_close(grp_logits, seq_logits, atol=TOL, rtol=0)
    assert seq_grads.keys() == grp_grads.keys()
    for name, grad in seq_grads.items():
        torch.testing.assert_close(grp_grads[name], grad, atol=TOL, rtol=0, msg=name)
    # Most experts got rows (their gradients were compared, not zeros with zeros).
    experts = [n for n in seq_grads if "local_experts" in n and "linear_fc2" in n]
    assert sum(bool(seq_grads[n].abs().max() > 0) for n in experts) > len(experts) // 2


def _graph_nodes(tensor: torch.Tensor) -> set:
    """Names of the autograd nodes behind ``tensor``."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return {type(n).__name__ for n in seen}


def test_expert_gradients_added_into_main_grad_equal_the_per_parameter_hooks(megatron_world):
    """The learner's experts are two stacked parameters per layer, whose weight gradients the
    grouped matmuls add straight into the data-parallel wrapper's main_grad buffers; the buffers
    hold what the per-parameter hooks would have added, and each expert's slice what
    SequentialMLP's loop gives that expert's weights."""
    from megatron_rl.config.schema import LearnerConfig
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.learner.megatron_step import wrap_for_training
    from megatron_rl.models.grouped_moe import GroupedExperts

    tokens = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    weights = None
    main_grads, expert_grads = [], []
    for into_main_grad in (True, False):
        sequential, model = _twin_models()
        wrapped, _ = wrap_for_training(model, LearnerConfig(), bf16=False, lr=1e-3)
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        assert experts and all(m.into_main_grad and m.parameters_stacked for m in experts)  # by the wrapper
        assert sum(1 for n, _ in model.named_parameters() if "experts" in n) == 2 * len(experts)
        for m in experts:
            m.into_main_grad = into_main_grad
        wrapped.zero_grad_buffer()
        if into_main_grad:
            # The first backward writes the buffers the wrapper has just zeroed (poisoned here: an
            # add would leave NaN), the second adds into them.
            for m in experts:
                for w in (m.linear_fc1_weights, m.linear_fc2_weights):
                    w.main_grad.fill_(float("nan"))
        for _ in range(2):  # two micro-batches accumulate
            logits = forward_logits(wrapped.train(), tokens)
            weights = torch.linspace(-1, 1, logits.numel()).view_as(logits)
            assert ("_GroupedLinearIntoMainGradBackward" in _graph_nodes((logits * weights).sum())) == into_main_grad
            (logits * weights).sum().backward()
        main_grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
        expert_grads.append([m.linear_fc1_weights.grad for m in experts])
    assert not any(m.zeroed.take(key) for m in experts for key in m.zeroed.KEYS)  # all written
    fused, hooked = main_grads
    assert fused.keys() == hooked.keys()
    for name, grad in hooked.items():
        torch.testing.assert_close(fused[name], grad, atol=TOL, rtol=0, msg=name)
    assert all(g is None for g in expert_grads[0])  # no expert gradient went through autograd
    # Against SequentialMLP's per-expert parameters, two micro-batches' worth.
    sequential.zero_grad(set_to_none=True)
    for _ in range(2):
        (forward_logits(sequential.train(), tokens) * weights).sum().backward()
    reference = {n: p.grad for n, p in sequential.named_parameters()}
    stacked = [n for n in fused if n.endswith("_weights")]
    assert stacked
    for name in stacked:
        layer = name.split(".mlp.")[0]
        projection = "linear_fc1" if "linear_fc1" in name else "linear_fc2"
        for e, grad in enumerate(fused[name]):
            torch.testing.assert_close(grad, reference[f"{layer}.mlp.experts.local_experts.{e}.{projection}.weight"],
                                       atol=TOL, rtol=0, msg=f"{name}[{e}]")
    assert sum(bool(fused[n][e].abs().max() > 0) for n in stacked for e in range(4)) > 2 * len(stacked)


def test_stacked_engine_weights_are_the_parameters(megatron_world):
    """The engine's stacked expert weights: the parameters are views of them, a state-dict copy
    (how engines load weights) lands in them, and the output equals the unstacked model's."""
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.grouped_moe import stack_expert_weights

    sequential, grouped = _twin_models()
    assert stack_expert_weights(grouped) == 2
    new = {k: v + 0.01 for k, v in sequential.state_dict().items() if "local_experts" in k and isinstance(v, torch.Tensor)}
    sequential.load_state_dict(new, strict=False)
    state = grouped.state_dict()
    for k, v in new.items():
        state[k].copy_(v)
    experts = grouped.decoder.layers[1].mlp.experts
    assert experts.stacked[0].data_ptr() == experts.local_experts[0].linear_fc1.weight.data_ptr()
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(grouped.eval(), tokens), forward_logits(sequential.eval(), tokens),
                                   atol=TOL, rtol=0)


def _router_top_k(layer, hidden):
    """The experts a layer's router picks for ``hidden`` [s, b, h], ascending per token."""
    logits = layer.router.gating(hidden).view(-1, layer.config.num_moe_experts)
    scores = torch.softmax(logits, -1) if layer.config.moe_router_pre_softmax else logits
    return torch.topk(scores, layer.config.moe_router_topk, dim=1).indices.sort(dim=1).values


def test_recorded_choices_are_the_routers_top_k(megatron_world):
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.routing import moe_layers, record_routing, recorded_choices

    _, model = _twin_models(num_layers=3, moe_layer_pattern=[1, 0, 1])
    layers = moe_layers(model)
    assert [layer.moe_index for layer in layers] == [0, 1] and [layer.layer_number for layer in layers] == [1, 3]
    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m.moe_index, args[0]))
             for layer in layers]
    record_routing(model)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        forward_logits(model.eval(), tokens)
    for hook in hooks:
        hook.remove()
    choices = recorded_choices(model)
    assert choices.dtype == torch.uint8 and choices.shape == (2, 14, 2)
    with torch.no_grad():
        for layer in layers:
            assert torch.equal(choices[layer.moe_index].long(), _router_top_k(layer, inputs[layer.moe_index]))


def test_replay_makes_a_perturbed_router_use_the_recorded_experts(megatron_world):
    """A learner whose router weights differ from the engine's picks other experts; replaying the
    engine's choices makes it use exactly those (checked per token and layer), gives the engine's
    logits back, and the agreement count says how often its own router disagreed."""
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.routing import RoutingReplay, record_routing, recorded_choices

    _, engine_model = _twin_models(num_layers=2)
    _, learner_model = _twin_models(num_layers=2)
    learner_model.load_state_dict(engine_model.state_dict())
    tokens = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(5))
    record_routing(engine_model)
    record_routing(learner_model)
    with torch.no_grad():
        engine_logits = forward_logits(engine_model.eval(), tokens)
        recorded = recorded_choices(engine_model).clone()
        for name, p in learner_model.named_parameters():
            if name.endswith("router.weight"):
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(6)))
        free_logits = forward_logits(learner_model.eval(), tokens)
        own = recorded_choices(learner_model).clone()
        assert not torch.equal(own, recorded)  # the perturbation changed some choices
        with RoutingReplay(learner_model, enforce=False) as compare:
            compare.set(recorded)
            forward_logits(learner_model, tokens)
            agree, total = compare.agreement()
        assert total == recorded.numel() and agree == (own.unsqueeze(-1) == recorded.unsqueeze(-2)).any(-1).sum()
        assert agree < total
        with RoutingReplay(learner_model, enforce=True) as replay:
            replay.set(recorded)
            replayed_logits = forward_logits(learner_model, tokens)
            assert torch.equal(recorded_choices(learner_model), recorded)
        # Only the router weights differ; with the engine's experts the gap is that of the probs.
        gap_free = (free_logits - engine_logits).abs().max()
        gap_replayed = (replayed_logits - engine_logits).abs().max()
        assert gap_replayed < gap_free
        # Unrecorded tokens (255) route by the learner's own router (compared in the first layer,
        # whose input does not depend on earlier layers' routing).
        partial = recorded.clone()
        partial[:, -3:] = 255
        with RoutingReplay(learner_model) as replay:
            replay.set(partial)
            forward_logits(learner_model, tokens)
        choices = recorded_choices(learner_model)
        assert torch.equal(choices[:, :-3], recorded[:, :-3]) and torch.equal(choices[0, -3:], own[0, -3:])
    # Detached on exit: the routers route freely again.
    with torch.no_grad():
        forward_logits(learner_model, tokens)
    assert torch.equal(recorded_choices(learner_model), own)


def _ep2_twins_case():
    """Rank body: SequentialMLP and grouped experts at EP=2 (megatron-core's alltoall dispatcher),
    the same weights on both; logits and this rank's gradients of each."""
    from megatron_rl.learner.parallel import init_model_parallel

    init_model_parallel(1, 1, 2, seed=0)
    sequential, grouped = _twin_models(num_experts=4, family="qwen3_moe")
    assert not grouped.decoder.layers[0].mlp.on_device_path()
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(8 + torch.distributed.get_rank()))
    seq = _logits_and_grads(sequential, tokens)
    grp = _logits_and_grads(grouped, tokens)
    return {"seq": seq, "grp": grp}


def test_grouped_experts_equal_sequential_mlp_at_ep2():
    for out in run_ranks(_ep2_twins_case, 2, timeout_s=240):
        (seq_logits, seq_grads), (grp_logits, grp_grads) = out["seq"], out["grp"]
        torch.testing.assert_close(grp_logits, seq_logits, atol=TOL, rtol=0)
        assert seq_grads.keys() == grp_grads.keys()
        for name, grad in seq_grads.items():
            torch.testing.assert_close(grp_grads[name], grad, atol=TOL, rtol=0, msg=name)


def test_replay_under_activation_recompute_gives_the_same_gradients(megatron_world):
    """With full activation recompute the backward re-runs each layer's forward: the replayed
    routing must be the same micro-batch's (two micro-batches, forwards before backwards, as a
    pipeline's warm-up runs them), so the gradients equal those without recompute."""
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.gpt import build_gpt_model
    from megatron_rl.models.routing import RoutingReplay

    _, plain = _twin_models(num_layers=2)
    torch.manual_seed(0)
    recomputed = build_gpt_model(_cfg(True), vocab_size=VOCAB, recompute=True)
    recomputed.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(9)
    batches = [torch.randint(0, VOCAB, (2, 8), generator=gen) for _ in range(2)]
    targets = [torch.randint(0, 4, (2, 16, 2), generator=gen).sort(-1).values.to(torch.uint8) for _ in range(2)]
    targets = [torch.where(t[..., :1] == t[..., 1:], torch.stack([t[..., 0], (t[..., 0] + 1) % 4], -1), t)
               for t in targets]  # two different experts per token

    def grads(model):
        model.train().zero_grad(set_to_none=True)
        with RoutingReplay(model) as replay:
            losses = []
            for tokens, target in zip(batches, targets):
                replay.set(target)
                losses.append((forward_logits(model, tokens) * torch.linspace(-1, 1, 2 * 8 * VOCAB).view(2, 8, VOCAB)).sum())
            for loss in losses:
                loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected, got = grads(plain), grads(recomputed)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=TOL, rtol=0, msg=name)


def _one_step(wrapped, optimizer, tokens):
    from megatron_rl.learner.learner import forward_logits

    wrapped.zero_grad_buffer()
    optimizer.zero_grad()
    logits = forward_logits(wrapped.train(), tokens)
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    wrapped.finish_grad_sync()
    optimizer.step()


@pytest.mark.parametrize("saved_by", ["stacked", "sequential"])
def test_checkpoints_move_between_stacked_and_per_expert_parameters(megatron_world, tmp_path, saved_by):
    """A distributed checkpoint (weights and Adam moments) of the learner's stacked experts loads
    into SequentialMLP's per-expert parameters and the other way round: the next step of both
    gives the same weights."""
    from types import SimpleNamespace

    from megatron_rl.checkpoint.save import load_checkpoint, save_checkpoint
    from megatron_rl.config.schema import LearnerConfig
    from megatron_rl.learner.megatron_step import wrap_for_training

    tokens = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(4))
    learners = {}
    for kind in ("sequential", "stacked"):
        model = _twin_models()[0 if kind == "sequential" else 1]
        wrapped, optimizer = wrap_for_training(model, LearnerConfig(), bf16=False, lr=1e-2)
        assert any(n.endswith("_weights") for n, _ in model.named_parameters()) == (kind == "stacked")
        learners[kind] = SimpleNamespace(module=model, model=wrapped, optimizer=optimizer)
    saver = learners[saved_by]
    loader = learners["stacked" if saved_by == "sequential" else "sequential"]
    _one_step(saver.model, saver.optimizer, tokens)
    path = save_checkpoint(saver, tmp_path, step=1, trainer_state={})
    load_checkpoint(loader, path)
    saved = {k: v.clone() for k, v in saver.module.state_dict().items() if isinstance(v, torch.Tensor)}
    for name, value in loader.module.state_dict().items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, saved[name], atol=0, rtol=0, msg=name)
    for learner in (saver, loader):
        _one_step(learner.model, learner.optimizer, tokens)
    after = saver.module.state_dict()
    moved = 0
    for name, value in loader.module.state_dict().items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, after[name], atol=TOL, rtol=0, msg=name)
            moved += "local_experts" in name and not torch.equal(value, saved[name])
    assert moved > 4  # the second step used the loaded Adam moments of the experts
