"""A batch's statistics per run, not per trajectory: an agent run can be several trajectories
(its history rewritten), each carrying the run's reward and counts, and a run counts once.

A run is a sample index within its group; a single-turn sample is a run of one trajectory, so
these are the per-sample statistics there."""

from __future__ import annotations

from typing import Dict, List, Sequence

from ...types import Trajectory

# Per-run counts an agent run records on each of its trajectories (Trajectory.agent_run).
AGENT_COUNTS = ("turns", "tool_calls", "context_overflows", "trajectories")


def runs(groups: Sequence[Sequence[Trajectory]]) -> List[Trajectory]:
    """The first trajectory of each run, in batch order (runs are told apart within their group:
    two groups of one batch may be the same prompt, drawn twice)."""
    out: List[Trajectory] = []
    for group in groups:
        seen: Dict[int, Trajectory] = {}
        for traj in group:
            seen.setdefault(traj.sample_index, traj)
        out += seen.values()
    return out


def agent_metrics(groups: Sequence[Sequence[Trajectory]]) -> Dict[str, float]:
    """``agent/<count>_mean`` per run (model turns, tool calls, trajectories, calls refused for
    the context length), ``agent/turns_max``, ``agent/context_overflows`` in the batch and
    ``agent/runs``; empty without agent runs."""
    counted = [t.agent_run for t in runs(groups) if t.agent_run is not None]
    if not counted:
        return {}
    out = {f"agent/{key}_mean": sum(c[key] for c in counted) / len(counted) for key in AGENT_COUNTS}
    out["agent/turns_max"] = float(max(c["turns"] for c in counted))
    out["agent/context_overflows"] = float(sum(c["context_overflows"] for c in counted))
    out["agent/runs"] = float(len(counted))
    return out
