"""megatron-core's ``jit_fuser`` made lazy on a CPU-only machine.

megatron-core decorates a few dozen fused element-wise functions with ``jit_fuser``, which is
``torch.compile``: each decoration imports ``torch._dynamo`` at once, about a third of the CPU
time of ``import megatron.core`` (2-3 CPU-s of 7-9 on the CI box), paid by every process that
imports megatron-core: each rank of a torchrun world, each test subprocess. On a machine without
CUDA those functions are not called on our paths (the CPU config turns megatron's fusions off),
so there ``jit_fuser`` becomes a decorator that calls ``torch.compile`` on the function's first
call instead: the same compiled function if one is ever called, and no dynamo import otherwise.
With CUDA nothing changes.

``install()`` (from ``megatron_rl/__init__.py``) puts a finder on ``sys.meta_path`` that wraps the
loader of ``megatron.core.jit`` only; it imports nothing itself, so processes that never import
megatron-core (reward workers) pay nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable, Optional

MODULE = "megatron.core.jit"


def lazy_compile(fn: Optional[Callable] = None, **kwargs: Any):
    """``torch.compile(fn, **kwargs)``, built on the first call of ``fn``."""
    if fn is None:
        return functools.partial(lazy_compile, **kwargs)
    compiled: list = []

    @functools.wraps(fn)
    def call(*args, **kw):
        if not compiled:
            import torch

            compiled.append(torch.compile(fn, **kwargs))
        return compiled[0](*args, **kw)

    return call


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile and not torch.cuda.is_available():
            module.jit_fuser = lazy_compile

    def __getattr__(self, name: str):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Once per process, before megatron-core is imported (a no-op if it already is)."""
    if MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
