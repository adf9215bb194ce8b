"""megatron-core's jit_fuser is lazy on a CPU-only machine (megatron_rl/lazy_jit.py): importing
megatron-core through megatron_rl does not import torch's compiler, and a decorated function
still computes what it computed (compiled on its first call)."""

import subprocess
import sys

import pytest
import torch

from megatron_rl.lazy_jit import lazy_compile

CHECK = """
import sys
import megatron_rl  # installs the finder, as every entry point does
import megatron.core.models.gpt, megatron.core.fusions.fused_bias_swiglu
from megatron.core import jit
print(jit.jit_fuser.__name__, "torch._dynamo" in sys.modules)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA jit_fuser stays torch.compile")
def test_importing_megatron_core_leaves_torch_compile_unloaded():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["lazy_compile", "False"]


def test_a_lazy_function_calls_torch_compile_once_on_its_first_call(monkeypatch):
    built = []

    def fake_compile(fn, **kwargs):  # torch.compile's contract: a callable computing fn
        built.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)

    def double(x):
        return x * 2

    lazy = lazy_compile(double)
    assert lazy.__name__ == "double" and built == []  # nothing built before the first call
    x = torch.arange(4.0)
    assert torch.equal(lazy(x), x * 2) and torch.equal(lazy(x + 1), (x + 1) * 2)
    assert built == [{}]
    assert torch.equal(lazy_compile(mode="max-autotune")(double)(x), x * 2)
    assert built == [{}, {"mode": "max-autotune"}]
