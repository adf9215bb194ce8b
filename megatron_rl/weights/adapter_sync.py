"""Adapter-only weight sync for a one-process LoRA run whose embedded engine applies the adapters
unmerged (``lora.sync=adapters``, ``models.lora.engine_applies_adapters``).

The engine's model carries the same adapted linears as the learner's, so it computes
``W·x + s·B·(A·x)`` exactly as the learner does and no merged weight is ever rounded to the
model's dtype. The base is frozen: the first push (at the start of a run, or of a resumed one)
sends it, under HF names as full weights travel, together with the adapters; every later push
sends the adapters alone, under their Megatron names (``decoder.layers.3.mlp.linear_fc1.lora_b``),
as the learner holds them, a fused A once. Each push is the engine's transactional swap (pause,
load, resume), so in-flight requests continue on the new version and every token carries the
version that sampled it, as with full weights.
"""

from __future__ import annotations

from .adapters import base_hf_tensors
from .transports import InProcessTransport, SyncMetrics


class AdapterTransport(InProcessTransport):
    """One process, LoRA, an engine that applies the adapters: the base once, then the adapters.
    ``sync/bytes`` is what one push handed to the engine, ``sync/adapter_only`` 1 after the first."""

    name = "in_process_adapters"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._base_sent = False

    async def _move(self, version: int) -> SyncMetrics:
        engine, = self.engines
        learner = self.worker.learner
        tensors = dict(learner.adapter_tensors())  # copies: the learner may train on while they load
        if not self._base_sent:
            tensors.update(base_hf_tensors(learner.module, self.worker.cfg.model))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        adapter_only = self._base_sent
        figures = await engine.swap_weights(tensors.items(), version) or {}
        self._base_sent = True
        return SyncMetrics(0.0, engine={**figures, "sync/bytes": float(nbytes), "sync/adapter_only": float(adapter_only)})
