"""Which transport carries the weights to which engine in which placement: ``TRANSPORTS`` (full
weights, keyed by engine kind and placement) and ``adapter_sync.ADAPTER_TRANSPORTS`` (a LoRA
learner's adapters, by placement), and the three lookups the composition root, the learner
ranks and the engine ranks make (``transport_for``, ``learner_sender``, ``engine_receiver``)."""

from __future__ import annotations

import contextlib
from typing import Any, Awaitable, Callable, Dict, Tuple

from ..api.engine import RolloutEngine
from ..errors import ConfigError
from .adapter_sync import ADAPTER_TRANSPORTS
from .transports import (BroadcastSender, BroadcastTransport, ChannelReceiver, ChannelTransport, ColocatedTransport,
                         InProcessTransport, LocalEngineSender, Span, TransportEntry, WorldReceiver)


PLACEMENTS = ("one_process", "colocated", "disaggregated")
ANY_ENGINE = "*"

TRANSPORTS: Dict[Tuple[str, str], TransportEntry] = {
    ("embedded", "one_process"): TransportEntry(InProcessTransport),
    ("vllm", "one_process"): TransportEntry(InProcessTransport),
    ("embedded", "colocated"): TransportEntry(ColocatedTransport, LocalEngineSender),
    ("vllm", "colocated"): TransportEntry(ColocatedTransport, LocalEngineSender),
    ("embedded", "disaggregated"): TransportEntry(BroadcastTransport, BroadcastSender, WorldReceiver),
    ("vllm", "disaggregated"): TransportEntry(ChannelTransport, BroadcastSender, ChannelReceiver),
    # Any other registered engine takes the weights as the embedded engine does: whole tensors
    # through its swap_weights (which the RolloutEngine interface declares), and on an engine rank
    # of the world over the weight-sync groups (its registry entry receives by groups).
    (ANY_ENGINE, "one_process"): TransportEntry(InProcessTransport),
    (ANY_ENGINE, "colocated"): TransportEntry(ColocatedTransport, LocalEngineSender),
    (ANY_ENGINE, "disaggregated"): TransportEntry(BroadcastTransport, BroadcastSender, WorldReceiver),
}


def transport_for(engine_kind: str, placement: str, adapters: bool = False) -> TransportEntry:
    """The transport of ``engine_kind`` in ``placement``; a combination without one is a
    ConfigError naming both and what exists. ``adapters``: the engine carries a LoRA learner's
    adapters (``models.lora.engine_applies_adapters``): the entries of
    ``adapter_sync.ADAPTER_TRANSPORTS``, which send the frozen base once and then the adapters."""
    if adapters and placement in ADAPTER_TRANSPORTS:
        return ADAPTER_TRANSPORTS[placement]
    entry = TRANSPORTS.get((engine_kind, placement)) or TRANSPORTS.get((ANY_ENGINE, placement))
    if entry is None:
        known = ", ".join(f"{kind} {where}" for kind, where in sorted(TRANSPORTS) if kind != ANY_ENGINE)
        raise ConfigError(f"no weight transport takes a rollout.engine={engine_kind} engine in the {placement} "
                          f"placement (there are transports for: {known}); register one in "
                          "megatron_rl/weights/transport_registry.py TRANSPORTS or choose another engine or placement")
    return entry


def learner_sender(engine_kind: str, placement: str, links: Any, adapters: bool = False) -> Any:
    """A learner rank's side (``send(learner, version)``): ``links`` are the rank's weight-sync
    groups (disaggregated) or its own engine and the loop its client lives on (colocated);
    ``adapters`` as for ``transport_for``."""
    return transport_for(engine_kind, placement, adapters).sender(links)


def engine_receiver(engine_kind: str, engine: RolloutEngine, links: Any,
                    span: Span = lambda *a, **k: contextlib.nullcontext(),
                    adapters: bool = False) -> Callable[[int], Awaitable[Any]]:
    """Beside an engine on an engine rank: the call the rank serves as ``receive_weights``
    (takes a version, returns the seconds its receive took; with ``adapters``, a dict of them
    and the push's figures)."""
    entry = transport_for(engine_kind, "disaggregated", adapters)
    return entry.receiver(engine, links, span).receive
