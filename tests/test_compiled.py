"""CompiledOrEager: compiled only where asked (GPU tensors), and after a failure of the compiled
function the eager one runs from then on, with one warning. Checked on a CPU with torch.compile
replaced by a stand-in that records its calls."""

import pytest
import torch

from megatron_rl.compiled import CompiledOrEager


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.fixture
def compile_calls(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        def compiled(*args, **kw):
            calls.append(args)
            raise RuntimeError("inductor exploded")
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


def test_cpu_tensors_run_the_eager_function_without_compiling(compile_calls):
    fn = CompiledOrEager(_double, "doubling")
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
    assert compile_calls == [] and fn._compiled is None and not fn.failed


def test_a_failing_compiled_function_falls_back_once_with_a_warning(compile_calls, caplog):
    fn = CompiledOrEager(_double, "doubling", only_cuda=False)
    with caplog.at_level("WARNING"):
        first, second = fn(torch.ones(2)), fn(torch.ones(2))
    assert torch.equal(first, torch.full((2,), 2.0)) and torch.equal(second, first)
    assert len(compile_calls) == 1 and fn.failed
    assert caplog.text.count("compiled doubling failed (inductor exploded)") == 1


def test_the_compiled_function_is_used_when_it_works(monkeypatch):
    seen = []

    def fake_compile(fn, **kwargs):
        def compiled(*args, **kw):
            seen.append(kwargs)
            return fn(*args, **kw)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    fn = CompiledOrEager(_double, "doubling", only_cuda=False)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    assert seen == [{"dynamic": True}] and not fn.failed


def test_running_out_of_memory_is_raised_not_taken_for_a_compiler_failure(monkeypatch):
    def oom_compile(fn, **kwargs):
        def compiled(*args, **kw):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return compiled

    monkeypatch.setattr(torch, "compile", oom_compile)
    fn = CompiledOrEager(_double, "doubling", only_cuda=False)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fn(torch.ones(2))
    assert not fn.failed
