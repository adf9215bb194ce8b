"""RoPE through torch.compile on a GPU without TransformerEngine, and compiled code beside threads.

megatron-core's unfused rotary function (``rope_utils._apply_rotary_pos_emb_bshd``) runs about ten
element-wise kernels per call (cos, sin, scale, casts, rotate-half's split, negate and concatenate,
two products and a sum) on the query and on the key of every layer, forward and backward; its
fused kernel needs TransformerEngine or apex. torch.compile turns the same expression into one
kernel. The learner and the rollout engine both call it (one forward, so their logprobs agree).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_installed = False


def use_compiled_rope() -> None:
    """Replace megatron-core's rotary function by a compiled one (once per process). Should
    compiling fail (no triton, an inductor error), the eager function is put back, with a warning."""
    global _installed
    if _installed:
        return
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    eager = rope_utils._apply_rotary_pos_emb_bshd
    compiled = torch.compile(eager, dynamic=True)

    def rotary(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an inductor/triton failure must not stop the run
            logger.warning("compiled RoPE failed (%s); using megatron-core's eager function", exc)
            rope_utils._apply_rotary_pos_emb_bshd = eager
            return eager(*args, **kwargs)

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
