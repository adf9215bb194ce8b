"""The _foreach multi-tensor kernels megatron-core's optimizer uses without TransformerEngine or
apex (learner/multi_tensor.py), against float64 and per-tensor references."""

import math

import pytest
import torch

from megatron_rl.learner.multi_tensor import foreach_l2norm, foreach_scale, use_foreach_kernels


def _tensors(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in ((5, 3), (7,), (2, 4, 6), (1,))]


def test_l2_norm_is_the_norm_of_all_entries_together():
    tensors = _tensors()
    total, per_tensor = foreach_l2norm(0, None, [tensors], True)
    expected = math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))
    assert total.shape == (1,) and total.dtype == torch.float32
    assert abs(float(total) - expected) <= 1e-6 * expected
    torch.testing.assert_close(per_tensor, torch.stack([t.double().norm() for t in tensors]).float())
    assert foreach_l2norm(0, None, [tensors], False)[1] is None
    assert math.isnan(float(foreach_l2norm(0, None, [tensors + [torch.tensor([float("nan")])]], False)[0]))


def test_scale_copies_clips_in_place_and_scales_into_other_tensors():
    src = _tensors()
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    foreach_scale(0, None, [src, dst], 1.0)  # fp32 main weights into bf16 model weights
    for s, d in zip(src, dst):
        assert torch.equal(d, s.to(torch.bfloat16))
    grads = _tensors()
    expected = [g * 0.25 for g in grads]
    foreach_scale(0, None, [grads, grads], 0.25)  # gradient clipping, in place
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)
    out = [torch.empty_like(t) for t in src]
    foreach_scale(0, None, [src, out], 3.0)
    for s, o in zip(src, out):
        assert torch.equal(o, s * 3.0)


def test_megatron_optimizer_modules_use_them_in_place_of_the_per_tensor_fallback():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    use_foreach_kernels()
    for module in (clip_grads, optimizer):
        for name in ("multi_tensor_applier", "l2_norm_impl", "multi_tensor_scale_impl"):
            assert getattr(module, name, None) not in (utils.local_multi_tensor_applier,
                                                      utils.local_multi_tensor_l2_norm,
                                                      utils.local_multi_tensor_scale)
    assert clip_grads.l2_norm_impl is foreach_l2norm
    assert use_foreach_kernels() == 0  # already done


def test_bf16_optimizer_copies_fp32_main_weights_into_the_model_weights(megatron_world):
    """With bf16 weights, megatron-core's optimizer copies its fp32 main weights back into the
    model after each step; here through one fused copy, with the same result as a per-tensor copy."""
    from megatron_rl.config.schema import LearnerConfig, ModelConfig
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.learner.megatron_step import wrap_for_training
    from megatron_rl.models.gpt import build_gpt_model

    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      dtype="bf16")
    model = build_gpt_model(cfg, vocab_size=64)
    wrapped, chained = wrap_for_training(model, LearnerConfig(lr=1e-2), bf16=True, lr=1e-2)
    optimizer = getattr(chained, "chained_optimizers", [chained])[0]
    assert optimizer._dummy_overflow_buf is not None  # the copy goes through multi_tensor_scale
    before = [p.detach().clone() for p in model.parameters()]
    wrapped.zero_grad_buffer()
    optimizer.zero_grad()
    logits = forward_logits(wrapped.train(), torch.randint(0, 64, (2, 9)))
    logits.float().pow(2).mean().backward()
    wrapped.finish_grad_sync()
    assert chained.step()[0]
    pairs = [(m, f) for mg, fg in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
             for m, f in zip(mg, fg)]
    assert pairs and all(torch.equal(m, f.to(torch.bfloat16)) for m, f in pairs)
    assert sum(not torch.equal(b, p) for b, p in zip(before, model.parameters())) > len(before) // 2


def test_token_count_scaling_of_the_gradient_buffers_takes_a_float(megatron_world):
    """megatron-core scales the gradient buffers by 1 / tokens given as a device scalar; the
    learner's wrapper multiplies by the same value as a float, with the same result."""
    from megatron_rl.config.schema import LearnerConfig, ModelConfig
    from megatron_rl.learner.megatron_step import wrap_for_training
    from megatron_rl.models.gpt import build_gpt_model

    torch.manual_seed(0)
    model = build_gpt_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                        ffn_hidden_size=48), vocab_size=64)
    wrapped, _ = wrap_for_training(model, LearnerConfig(), bf16=False, lr=1e-3)
    wrapped.defer_scale = False  # the folded step's deferral: test_folded_step below
    buffer = wrapped.buffers[0].grad_data
    buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(1)))
    factor = 1.0 / torch.tensor(7, dtype=torch.int)  # what finalize_model_grads passes
    expected = buffer * factor
    seen = []
    original = type(wrapped.buffers[0]).scale_gradients
    type(wrapped.buffers[0]).scale_gradients = lambda self, f: (seen.append(f), original(self, f))
    try:
        wrapped.scale_gradients(factor)
    finally:
        type(wrapped.buffers[0]).scale_gradients = original
    assert seen and all(isinstance(f, float) for f in seen)
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("clip", [0.0, 1e-3, 1e6])  # off, clipping, a bound above the norm
@pytest.mark.parametrize("bf16", [False, True])
def test_folded_step_equals_megatrons_scale_clip_and_adam(megatron_world, clip, bf16):
    """The learner's step with the 1 / tokens factor and the clip folded into fused Adam's unscale
    (learner/folded_step.py) gives megatron-core's step (scale the buffers, clip, Adam): the same
    gradient norm and weights, and skips a NaN gradient leaving weights and Adam state alone."""
    from megatron_rl.config.schema import LearnerConfig, ModelConfig
    from megatron_rl.learner.folded_step import folded_step, torch_fused_adams
    from megatron_rl.learner.megatron_step import wrap_for_training
    from megatron_rl.models.gpt import build_gpt_model

    def build():
        torch.manual_seed(0)
        model = build_gpt_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                            ffn_hidden_size=48, dtype="bf16" if bf16 else "fp32"), vocab_size=64)
        # A large eps: the update then grows with the gradient (Adam alone is blind to its scale).
        return wrap_for_training(model, LearnerConfig(clip_grad=clip, weight_decay=0.1, adam_eps=1e-2), bf16=bf16, lr=1e-2)

    (folded, folded_opt), (plain, plain_opt) = build(), build()
    assert folded.defer_scale and torch_fused_adams(folded_opt)
    plain.defer_scale = False
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [torch.randn(b.grad_data.shape, generator=gen) * 10 for b in folded.buffers]
        factor = 1.0 / torch.tensor(7 + step, dtype=torch.int)  # what finalize_model_grads passes
        for model in (folded, plain):
            for b, g in zip(model.buffers, grads):
                b.grad_data.copy_(g)
            model.scale_gradients(factor)
        cause, norm = folded_step(folded_opt, folded.take_grad_factor())
        ok, expected_norm, _ = plain_opt.step()
        assert cause is None and ok
        assert norm == pytest.approx(expected_norm, rel=1e-6)
        main = lambda opt: [p for g in opt.optimizer.param_groups for p in g["params"]]  # noqa: E731 (fp32)
        for a, b in zip(main(folded_opt), main(plain_opt)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(folded.parameters(), plain.parameters()):  # a bf16 rounding apart at most
            torch.testing.assert_close(a, b, rtol=2 ** -7 if bf16 else 1e-6, atol=1e-7)
    weights = [p.detach().clone() for p in folded.parameters()]
    state = [s["exp_avg"].clone() for s in folded_opt.optimizer.state.values()]
    folded.buffers[0].grad_data[3] = float("nan")
    cause, norm = folded_step(folded_opt, 0.5)
    assert cause == "the gradient norm is not finite" and norm is None
    assert all(torch.equal(a, b) for a, b in zip(weights, folded.parameters()))
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(state, folded_opt.optimizer.state.values()))
