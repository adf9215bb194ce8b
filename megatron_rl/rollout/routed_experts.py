"""A sample's recorded mixture-of-experts routing, as the rollout side assembles it.

The engine returns, with a request's tokens, the experts each MoE layer chose for every position
it computed: a [positions, moe_layers, top_k] integer array (uint8, 255 where nothing was
recorded; int16 with -1 from 256 experts on). A trajectory carries one row per position of its
prompt + response (``Trajectory.routed_experts``); the learner replays them (models/routing.py).

Each position keeps its first record: the routing the token was actually computed with. An agent's
later turn computes its whole prompt again (earlier turns' tokens included), possibly under newer
weights; those rows never replace the earlier turn's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def unrecorded(dtype) -> int:
    """The id that marks "nothing recorded" in an array of ``dtype``."""
    return 255 if np.dtype(dtype) == np.uint8 else -1


def over_positions(routed: Optional[np.ndarray], positions: int) -> Optional[np.ndarray]:
    """The engine's rows for positions 0..``positions``-1, padded with "unrecorded" (it never
    computes a response's last token); None stays None."""
    if routed is None:
        return None
    routed = np.asarray(routed)
    if len(routed) > positions:
        raise ValueError(f"routed experts for {len(routed)} positions of a {positions}-token sequence: the engine's "
                         "routing does not match its tokens")
    if len(routed) == positions:
        return routed
    pad = np.full((positions - len(routed), *routed.shape[1:]), unrecorded(routed.dtype), dtype=routed.dtype)
    return np.concatenate([routed, pad])


def first_records(parts: Sequence[Optional[np.ndarray]], positions: int) -> Optional[np.ndarray]:
    """One [positions, moe_layers, top_k] array from records of the same positions made in order
    (e.g. an agent's turns, each covering a prefix of the sequence): each position and layer keeps
    the first record made of it. None when no part recorded anything."""
    parts = [np.asarray(p) for p in parts if p is not None]
    if not parts:
        return None
    first = parts[0]
    out = np.full((positions, *first.shape[1:]), unrecorded(first.dtype), dtype=first.dtype)
    missing = unrecorded(first.dtype)
    for part in parts:
        part = part[:positions]
        rows = out[: len(part)]  # a view: writes land in ``out``
        take = (rows[..., 0] == missing) & (part[..., 0] != missing)  # [positions, layers]
        rows[take] = part[take]
    return out
