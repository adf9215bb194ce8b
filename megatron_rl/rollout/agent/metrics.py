"""A batch's statistics per run, not per trajectory: an agent run can be several trajectories
(its history rewritten), each carrying the run's reward and counts, and a run counts once.

A run is a (prompt uid, sample index) pair; a single-turn sample is a run of one trajectory, so
these are the per-sample statistics there."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ...types import Trajectory

# Per-run counts an agent run records on each of its trajectories (Trajectory.agent_run).
AGENT_COUNTS = ("turns", "tool_calls", "context_overflows", "trajectories")


def runs(flat: Sequence[Trajectory]) -> List[Trajectory]:
    """The first trajectory of each run, in batch order."""
    seen: Dict[Tuple[str, int], Trajectory] = {}
    for traj in flat:
        seen.setdefault((traj.prompt_uid, traj.sample_index), traj)
    return list(seen.values())


def agent_metrics(flat: Sequence[Trajectory]) -> Dict[str, float]:
    """``agent/<count>_mean`` per run (model turns, tool calls, trajectories, calls refused for
    the context length) and ``agent/context_overflows`` in the batch; empty without agent runs."""
    counted = [t.agent_run for t in runs(flat) if t.agent_run is not None]
    if not counted:
        return {}
    out = {f"agent/{key}_mean": sum(c[key] for c in counted) / len(counted) for key in AGENT_COUNTS}
    out["agent/turns_max"] = float(max(c["turns"] for c in counted))
    out["agent/context_overflows"] = float(sum(c["context_overflows"] for c in counted))
    out["agent/runs"] = float(len(counted))
    return out
