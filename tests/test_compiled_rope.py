"""Compiled code on a GPU: RoPE's compiled function falls back to megatron-core's eager one when
compiling fails, and a compiled call made while another thread traces runs eagerly (the FX
tracing flag is process-wide). Both are plain Python seams, checked here on a CPU."""

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


def test_compiled_rope_falls_back_to_the_eager_function(monkeypatch, caplog):
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.models import compiled_rope

    eager = rope_utils._apply_rotary_pos_emb_bshd

    def failing_compile(fn, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("no triton")
        return compiled

    monkeypatch.setattr(compiled_rope, "_installed", False)
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", eager)
    monkeypatch.setattr(torch, "compile", failing_compile)
    compiled_rope.use_compiled_rope()
    assert rope_utils._apply_rotary_pos_emb_bshd is not eager
    t, freqs = torch.randn(5, 2, 3, 8), torch.randn(5, 1, 1, 8)
    with caplog.at_level("WARNING"):
        out = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    assert torch.equal(out, eager(t, freqs))
    assert rope_utils._apply_rotary_pos_emb_bshd is eager  # put back for every later call
    assert "compiled RoPE failed" in caplog.text
