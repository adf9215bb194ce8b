"""Per-step figures the driver adds to a step's metrics from counters that only grow."""

from __future__ import annotations

import copy
from typing import Any, Dict


class EngineCounters:
    """An engine's counters (``RolloutEngine.stats``) since the previous step: batches built and
    decode steps, the mean number of running rows per decode step (continuous batching keeps it
    up), and where the engine's compute time went."""

    def __init__(self, stats: Any):
        self._prev = copy.copy(stats)

    def since_last(self, stats: Any) -> Dict[str, float]:
        prev = self._prev
        steps = stats.decode_steps - prev.decode_steps
        out = {
            "engine/prefills": float(stats.prefills - prev.prefills),
            "engine/admissions": float(stats.admissions - prev.admissions),
            "engine/decode_steps": float(steps),
            "engine/rows_per_decode": (stats.decode_rows - prev.decode_rows) / steps if steps else 0.0,
            **{f"engine/{kind}_s": getattr(stats, f"{kind}_s") - getattr(prev, f"{kind}_s")
               for kind in ("prefill", "admit", "decode")},
            # Decode buckets captured during the step after the engine's start (stalls on a GPU).
            "engine/late_captures": float(stats.late_captures - prev.late_captures),
        }
        self._prev = copy.copy(stats)
        return out
