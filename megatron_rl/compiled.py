"""A function compiled by torch.compile where that pays, with its eager code as the fallback.

Several hot paths (the learner's vocabulary-chunk kernels, the engine's sampling, RoPE) are short
element-wise expressions that run as many kernels eagerly and as one or two once compiled. An
inductor or triton failure (no compiler, an unsupported op, a driver quirk) must not stop a run:
the same arithmetic runs eagerly instead, and the log says so once.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)


class CompiledOrEager:
    """Call ``eager`` compiled (``torch.compile(eager, dynamic=True)``, built on first use).

    ``only_cuda``: compile only when the first tensor argument is on a GPU (on a CPU the eager
    kernels are the better choice: compiling costs seconds and CPU codegen gains little). After the
    first failure of the compiled function every later call runs ``eager``; the warning names
    ``what`` and the error."""

    def __init__(self, eager: Callable[..., Any], what: str, only_cuda: bool = True):
        self.eager = eager
        self.what = what
        self.only_cuda = only_cuda
        self.failed = False
        self._compiled: Optional[Callable[..., Any]] = None

    def _wants_compile(self, args) -> bool:
        if self.failed:
            return False
        if not self.only_cuda:
            return True
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return tensor is not None and tensor.is_cuda

    def __call__(self, *args, **kwargs):
        if not self._wants_compile(args):
            return self.eager(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.eager, dynamic=True)
        try:
            return self._compiled(*args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise  # the eager kernels need as much memory: not a compiler failure
        except Exception as exc:  # noqa: BLE001 - an inductor/triton failure must not stop the run
            logger.warning("compiled %s failed (%s); running it eagerly from now on", self.what, exc)
            self.failed = True
            return self.eager(*args, **kwargs)
