"""RoPE through torch.compile on a GPU without TransformerEngine, and compiled code beside threads.

megatron-core's unfused rotary function (``rope_utils._apply_rotary_pos_emb_bshd``) runs about ten
element-wise kernels per call (cos, sin, scale, casts, rotate-half's split, negate and concatenate,
two products and a sum) on the query and on the key of every layer, forward and backward; its
fused kernel needs TransformerEngine or apex. torch.compile turns the same expression into one
kernel, and the sine and cosine are computed once per forward rather than once per element (see
``cos_sin``). The learner and the rollout engine both call it (one forward, so their logprobs agree).
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

import torch
from megatron.core.models.common.embeddings.rope_utils import _rotate_half

from ..compiled import CompiledOrEager

_installed = False


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """megatron-core's rotation of ``t``'s first ``cos.shape[-1]`` features, cos and sin given."""
    rot_dim = cos.shape[-1]
    if rot_dim == t.shape[-1]:
        return t * cos + _rotate_half(t, interleaved) * sin
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((rotated * cos + _rotate_half(rotated, interleaved) * sin, passed), dim=-1)


_ROTATE = CompiledOrEager(_rotate, "RoPE", only_cuda=False)


class _ForwardMemos(threading.local):
    """Per thread (the engine and a colocated learner run forwards on their own threads): a stack
    of memos, one per model forward in progress."""

    def __init__(self):
        self.stack: list = []


_memos = _ForwardMemos()


def cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cos(freqs) * mscale, sin(freqs) * mscale) in ``dtype``, as megatron-core computes them.

    Within a model forward (``memoize_rotary_per_forward``) they are computed once per frequency
    tensor and shared by every layer: the query and key of every layer get the same table. Computed
    inside the rotation kernel instead, sin and cos run once per element of every head of every
    layer: at 256 prompts of 512 tokens RoPE took 49 ms of a 650 ms prefill's kernels on an H200,
    far above what moving its bytes costs. A memo entry holds its tensor, so no other tensor can
    take its address while the entry lives; the version counter catches an in-place change (an
    inference-mode tensor has none: it is not memoized)."""
    memo: Optional[Dict[tuple, Tuple[torch.Tensor, ...]]] = _memos.stack[-1] if _memos.stack else None
    if memo is None or freqs.is_inference():
        return _scaled_cos_sin(freqs, mscale, dtype)
    key = (freqs.data_ptr(), freqs.device, tuple(freqs.shape), freqs.stride(), freqs._version, mscale, dtype)
    if key not in memo:
        memo[key] = (freqs, *_scaled_cos_sin(freqs, mscale, dtype))
    return memo[key][1:]


def _scaled_cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def memoize_rotary_per_forward(model: torch.nn.Module) -> None:
    """Open a cos/sin memo for each forward of ``model`` (closed when it returns or raises). A
    CUDA graph's capture is one forward: what it memoizes lives in that capture alone."""
    def open_memo(module, args) -> None:
        _memos.stack.append({})

    def close_memo(module, args, output) -> None:
        _memos.stack.pop()

    model.register_forward_pre_hook(open_memo)
    model.register_forward_hook(close_memo, always_call=True)


def use_compiled_rope() -> None:
    """Replace megatron-core's rotary function by one whose rotation is compiled (one kernel) and
    whose cos/sin come from ``cos_sin`` (once per forward). Should compiling fail (no triton, an
    inductor error), the rotation runs eagerly, with a warning. Multi-latent attention's rotary
    (its features de-interleaved first) keeps megatron-core's function, compiled."""
    global _installed
    if _installed:
        return
    from megatron.core.models.common.embeddings import rope_utils

    mla_rotary = CompiledOrEager(rope_utils._apply_rotary_pos_emb_bshd, "RoPE (MLA)", only_cuda=False)

    def rotary(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
               multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
        if multi_latent_attention:
            return mla_rotary(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, sin = cos_sin(freqs, mscale, t.dtype)
        return _ROTATE(t, cos, sin, rotary_interleaved)

    rope_utils._apply_rotary_pos_emb_bshd = rotary
    _installed = True


def compiled_calls_beside_tracing() -> None:
    """Let a compiled function run (eagerly) while another thread traces one.

    torch.compile traces a function with FX, and FX's "tracing now" flag is global to the process,
    not to the thread. With the engine decoding on its thread while the learner compiles on its
    own (eta > 0 in one process: seen on an H200, the first training step compiling while the
    engine decoded), every compiled call the engine made during that time raised "Detected that
    you are using FX to symbolically trace a dynamo-optimized function". With this setting such a
    call runs the function's eager code instead: the same arithmetic, for the few seconds a
    compile takes."""
    import torch._dynamo

    torch._dynamo.config.error_on_nested_fx_trace = False
