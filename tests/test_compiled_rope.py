"""Compiled code on a GPU: RoPE's rotation with cos/sin computed once per forward equals
megatron-core's function, falls back to eager arithmetic when compiling fails, and a compiled call
made while another thread traces runs eagerly (the FX tracing flag is process-wide). All plain
Python seams, checked here on a CPU."""

import pytest
import torch


def test_a_compiled_call_beside_another_threads_trace_runs_eagerly(monkeypatch):
    import torch._dynamo
    import torch.fx._symbolic_trace as fx_trace

    from megatron_rl.models.compiled_rope import compiled_calls_beside_tracing

    add_one = torch.compile(lambda x: x + 1)
    monkeypatch.setattr(torch._dynamo.config, "error_on_nested_fx_trace", True)  # torch's default
    monkeypatch.setattr(fx_trace, "_is_fx_tracing_flag", True)  # as while another thread compiles
    with pytest.raises(RuntimeError, match="symbolically trace a dynamo-optimized function"):
        add_one(torch.ones(2))
    compiled_calls_beside_tracing()
    assert torch.equal(add_one(torch.ones(2)), torch.full((2,), 2.0))


@pytest.fixture
def compiled_rope_installed(monkeypatch):
    """use_compiled_rope() on a CPU, undone afterwards; torch.compile stands in as the identity
    (on a CPU the rotation is then exactly the eager arithmetic)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.compiled import CompiledOrEager
    from megatron_rl.models import compiled_rope

    monkeypatch.setattr(compiled_rope, "_installed", False)
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", rope_utils._apply_rotary_pos_emb_bshd)
    monkeypatch.setattr(compiled_rope, "_ROTATE", CompiledOrEager(compiled_rope._rotate, "RoPE", only_cuda=False))
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    megatron_rotary = rope_utils._apply_rotary_pos_emb_bshd
    compiled_rope.use_compiled_rope()
    return megatron_rotary, rope_utils._apply_rotary_pos_emb_bshd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_dim,mscale", [(8, 1.0), (4, 1.3)])
def test_rotary_with_cos_sin_given_equals_megatrons_function(compiled_rope_installed, dtype, interleaved, rot_dim,
                                                            mscale):
    megatron_rotary, rotary = compiled_rope_installed
    torch.manual_seed(0)
    t = torch.randn(5, 2, 3, 8).to(dtype)
    freqs = torch.randn(5, 1, 1, rot_dim) * 3
    got = rotary(t, freqs, rotary_interleaved=interleaved, mscale=mscale)
    assert torch.equal(got, megatron_rotary(t, freqs, rotary_interleaved=interleaved, mscale=mscale))


def test_cos_sin_are_computed_once_per_forward_and_not_kept_after_it(megatron_world, tiny_cfg, compiled_rope_installed,
                                                                     monkeypatch):
    """A two-layer model: its four rotations (query and key of each layer) share one cos/sin, the
    logits equal those of megatron-core's rotary function, and the memo closes with the forward,
    also when the forward raises."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.models import compiled_rope
    from megatron_rl.models.gpt import build_gpt_model, model_device

    megatron_rotary, rotary = compiled_rope_installed
    torch.manual_seed(3)
    model = build_gpt_model(tiny_cfg.model, vocab_size=16)
    assert model.config.num_layers == 2
    tokens = torch.randint(0, 16, (2, 9), device=model_device())
    positions = torch.arange(9, device=tokens.device).expand(2, 9)
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", megatron_rotary)
    expected = model(tokens, positions, None)

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", rotary)
    compiled_rope.memoize_rotary_per_forward(model)
    computed, real_cos = [], torch.cos
    monkeypatch.setattr(torch, "cos", lambda x: computed.append(x.shape) or real_cos(x))
    got = model(tokens, positions, None)
    assert torch.equal(got, expected)
    assert len(computed) == 1, computed
    assert compiled_rope._memos.stack == []
    with pytest.raises(Exception):
        model(tokens[:, :0], positions[:, :0], None)
    assert compiled_rope._memos.stack == []


def test_inference_mode_frequencies_are_rotated_without_a_memo(compiled_rope_installed):
    """An inference-mode tensor has no version counter to key a memo on: computed directly."""
    from megatron_rl.models import compiled_rope

    megatron_rotary, rotary = compiled_rope_installed
    t = torch.randn(5, 2, 3, 8)
    with torch.inference_mode():
        freqs = torch.randn(5, 1, 1, 8)
        compiled_rope._memos.stack.append({})
        try:
            out = rotary(t, freqs)
            assert compiled_rope._memos.stack[-1] == {}
        finally:
            compiled_rope._memos.stack.pop()
    assert torch.equal(out, megatron_rotary(t, freqs))


def test_compiled_rope_falls_back_to_the_eager_function(compiled_rope_installed, monkeypatch, caplog):
    from megatron_rl.compiled import CompiledOrEager
    from megatron_rl.models import compiled_rope

    megatron_rotary, rotary = compiled_rope_installed
    compiled_calls = []

    def failing_compile(fn, **kwargs):
        def compiled(*args, **kw):
            compiled_calls.append(1)
            raise RuntimeError("no triton")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.setattr(compiled_rope, "_ROTATE", CompiledOrEager(compiled_rope._rotate, "RoPE", only_cuda=False))
    t, freqs = torch.randn(5, 2, 3, 8), torch.randn(5, 1, 1, 8)
    with caplog.at_level("WARNING"):
        out = rotary(t, freqs)
        again = rotary(t, freqs)
    assert torch.equal(out, megatron_rotary(t, freqs)) and torch.equal(again, out)
    assert len(compiled_calls) == 1  # every later call runs the eager function
    assert caplog.text.count("compiled RoPE failed") == 1
