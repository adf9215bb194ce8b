"""Adapter-only weight sync for a LoRA run whose engines carry the adapters (``lora.sync=adapters``,
``models.lora.engine_applies_adapters``), in every placement: embedded engines, which apply them
unmerged; vLLM, which serves them as a LoRA of its own (``rollout/vllm/engine.py``: each push's
adapters become a PEFT directory that vLLM loads).

The engine's model carries the same adapted linears as the learner's, so it computes
``W·x + s·B·(A·x)`` exactly as the learner does and no merged weight is ever rounded to the
model's dtype. The base is frozen: the first push (at the start of a run, or of a resumed one)
sends it, under HF names as full weights travel, together with the adapters; every later push
sends the adapters alone, under their Megatron names (``decoder.layers.3.mlp.linear_fc1.lora_b``),
as full tensors (gathered over tensor parallelism the way ``reshard.full_tensors`` gathers
weights: the engine runs at TP = 1), a fused A once. Each push is the engine's transactional
swap (pause, load, resume), so in-flight requests continue on the new version and every token
carries the version that sampled it, as with full weights.

Entries by placement (``ADAPTER_TRANSPORTS``, looked up by ``transport_registry.transport_for``):
- one_process: ``AdapterTransport`` hands the tensors to the engine (or its process);
- colocated: every learner rank gathers every stage's (``export.all_stage_tensors``) and loads
  its own engine (``AdapterLocalSender``);
- disaggregated: each stage's source broadcasts its stage over the world's weight-sync groups
  (``AdapterBroadcastSender``), the engine ranks take them (``AdapterWorldReceiver``). A vLLM
  engine rank takes them the same way, into host memory over gloo groups (its workers are not
  ranks of the world; ``launch/run.py``), and loads its engine: the base through vLLM's own
  weight channel, the adapters as its LoRA.
Each reports ``sync/bytes`` (what one engine received in the push) and ``sync/adapter_only``
(1 once the base has gone).
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch

from .adapters import base_hf_tensors
from .transports import (BroadcastTransport, ColocatedTransport, InProcessTransport, LocalEngineSender, SyncMetrics,
                         TransportEntry, WorldReceiver, check_version, in_daemon_thread)


def push_figures(tensors: Dict[str, torch.Tensor], adapter_only: bool) -> Dict[str, float]:
    """A push's ``sync/bytes`` and ``sync/adapter_only``."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"sync/bytes": float(nbytes), "sync/adapter_only": float(adapter_only)}


class AdapterStage:
    """A learner rank's export of its pipeline stage for adapter-only sync: the frozen base
    (unmerged, HF names) on the first push of this process, then the adapters alone. Collective
    over the TP/EP groups, as every export is; each learner rank keeps its own record of the
    base having gone (every rank takes part in every push, so the records agree)."""

    def __init__(self) -> None:
        self.base_sent = False

    def tensors(self, learner) -> Iterator[Tuple[str, torch.Tensor]]:
        if not self.base_sent:
            yield from base_hf_tensors(learner.module, learner.cfg.model)
        yield from learner.adapter_tensors()


# ---------------------------------------------------------------------------- one process
class AdapterTransport(InProcessTransport):
    """One process, LoRA, an engine that applies the adapters: the base once, then the adapters."""

    name = "in_process_adapters"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stage = AdapterStage()

    async def _move(self, version: int) -> SyncMetrics:
        engine, = self.engines
        # Copies (full_tensors clones): the learner may train on while they load.
        tensors = dict(self._stage.tensors(self.worker.learner))
        figures = push_figures(tensors, adapter_only=self._stage.base_sent)
        engine_figures = await engine.swap_weights(tensors.items(), version) or {}
        self._stage.base_sent = True
        return SyncMetrics(0.0, engine={**engine_figures, **figures})


# ---------------------------------------------------------------------------- colocated
class AdapterColocatedTransport(ColocatedTransport):
    """Colocated: every learner rank loads its own engine (``AdapterLocalSender``); the driver's
    rank reports the push's figures."""

    name = "colocated_adapters"

    async def _move(self, version: int) -> SyncMetrics:
        figures = await self.run_on_learners("send_weights", version)
        return SyncMetrics(0.0, engine=dict(figures or {}))


class AdapterLocalSender(LocalEngineSender):
    """Colocated: this rank's engine loads every stage's base (first push) or adapters (later)."""

    def __init__(self, local):
        super().__init__(local)
        self._stage = AdapterStage()

    def send(self, learner, version: int) -> Dict[str, float]:
        from .export import all_stage_tensors

        tensors = dict(all_stage_tensors(learner.module, lambda: self._stage.tensors(learner)))
        figures = push_figures(tensors, adapter_only=self._stage.base_sent)
        self._load_own_engine(tensors.items(), version)
        self._stage.base_sent = True
        return figures


# ---------------------------------------------------------------------------- disaggregated
class AdapterBroadcastTransport(BroadcastTransport):
    """Disaggregated: the stages' sources broadcast the base once, then the adapters alone; the
    engine ranks report what they received (every engine receives the same)."""

    name = "world_broadcast_adapters"

    async def _move(self, version: int) -> SyncMetrics:
        import asyncio

        sent, *received = await asyncio.gather(self.run_on_learners("send_weights", version),
                                               *(e.receive_weights(version) for e in self.engines))
        figures = [r for r in received if r]
        receive_s = max(f["receive_s"] for f in figures) if figures else None
        engine = {k: v for k, v in figures[0].items() if k != "receive_s"} if figures else {}
        return SyncMetrics(0.0, send_s=sent, receive_s=receive_s, engine=engine)


class AdapterBroadcastSender:
    """Each stage's source broadcasts its stage's base (first push) or adapters (later) over the
    world's weight-sync groups; the stage's other learner ranks help gather."""

    def __init__(self, groups):
        self.groups = groups
        self._stage = AdapterStage()

    def send(self, learner, version: int) -> Optional[float]:
        from .sync import send_stage_tensors

        stats = send_stage_tensors(self._stage.tensors(learner), self.groups, version)
        self._stage.base_sent = True
        return stats.seconds if stats is not None else None


class AdapterWorldReceiver(WorldReceiver):
    """An engine with the adapters on an engine rank (embedded, or vLLM): the base and adapters,
    or the adapters alone, swapped in whole; returns its receive's seconds with the push's figures."""

    async def receive(self, version: int) -> Dict[str, float]:
        from ..models.lora import is_adapter_name
        from .sync import receive_weights

        with self.span("sync", version=version):
            got, tensors, stats = await in_daemon_thread(receive_weights, self.groups)
        check_version(version, got)
        figures = push_figures(tensors, adapter_only=all(is_adapter_name(n) for n in tensors))
        with self.span("swap", version=version):
            await self.engine.swap_weights(tensors.items(), version)
        return {"receive_s": stats.seconds, **figures}


ADAPTER_TRANSPORTS: Dict[str, TransportEntry] = {
    "one_process": TransportEntry(AdapterTransport),
    "colocated": TransportEntry(AdapterColocatedTransport, AdapterLocalSender),
    "disaggregated": TransportEntry(AdapterBroadcastTransport, AdapterBroadcastSender, AdapterWorldReceiver),
}
