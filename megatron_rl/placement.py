"""Placement planning: which global rank does what, and which ranks form which groups.

A pure function of the world (size, GPUs per node) and the parallel layout asked for; nothing
here touches torch.distributed, so a plan can be printed (``--dry-run``) and tested anywhere.

- **disaggregated**: learners on ranks ``[0, L)`` and engines on the rest, each engine on
  ``rollout.tp`` consecutive ranks of one node. The learners come first because megatron-core
  lays its groups out from rank 0 (see ``groups.py``).
- **colocated**: every rank is a learner rank and also hosts one member of an engine, which
  sleeps while the learner trains; ``rollout.engines × rollout.tp`` must equal the world size.
  Weights move within the node (shared memory on CPU; CUDA IPC on GPU), not over the sync group.

Megatron's rank order inside the learner is ``tp-cp-ep-dp-pp`` (TP fastest): TP groups are
consecutive ranks, so they stay inside a node when the GPUs per node are a multiple of TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .errors import UserError

PLACEMENTS = ("colocated", "disaggregated")


class PlacementError(UserError):
    """A layout that cannot be placed; the message says why and what would fit."""


@dataclass(frozen=True)
class Layout:
    """What the user asked for (``learner.*``, ``rollout.*``)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: Optional[int] = None  # derived when None
    engines: int = 1
    engine_tp: int = 1
    placement: str = "disaggregated"
    engine_kind: str = "embedded"
    # The engines carry a LoRA learner's adapters (lora.sync=adapters): a vLLM engine rank then
    # takes the pushes itself over gloo groups of the world, not its workers over weight channels.
    engine_adapters: bool = False


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: int
    local_rank: int
    role: str                     # learner | engine | learner+engine
    tp_rank: Optional[int] = None
    cp_rank: Optional[int] = None
    dp_rank: Optional[int] = None
    pp_rank: Optional[int] = None
    engine: Optional[int] = None  # engine index
    engine_member: Optional[int] = None  # rank within that engine (its TP rank)
    sync_source: bool = False     # sends its pipeline stage's weights to the engines


@dataclass(frozen=True)
class Plan:
    world_size: int
    gpus_per_node: int
    layout: Layout
    dp: int
    learner_ranks: Tuple[int, ...]
    engine_groups: Tuple[Tuple[int, ...], ...]
    sync_sources: Tuple[int, ...]   # one per pipeline stage (disaggregated); empty when colocated
    ranks: Tuple[RankInfo, ...]

    @property
    def engine_ranks(self) -> Tuple[int, ...]:
        return tuple(r for group in self.engine_groups for r in group)

    @property
    def sync_groups(self) -> Tuple[Tuple[int, ...], ...]:
        """The weight-sync groups: each stage's source plus every engine rank."""
        return tuple((src, *self.engine_ranks) for src in self.sync_sources)

    def table(self) -> str:
        lay = self.layout
        head = (f"world {self.world_size} ({self.gpus_per_node} per node), {lay.placement}: learner "
                f"tp={lay.tp} pp={lay.pp} cp={lay.cp} ep={lay.ep} dp={self.dp} on {len(self.learner_ranks)} "
                f"ranks; {len(self.engine_groups)} {lay.engine_kind} engine(s) x tp={lay.engine_tp}")
        cols = ("rank", "node", "local", "role", "tp", "cp", "dp", "pp", "engine", "member", "sync")
        rows = [cols]
        for r in self.ranks:
            rows.append(tuple("-" if v is None else str(v) for v in (
                r.rank, r.node, r.local_rank, r.role, r.tp_rank, r.cp_rank, r.dp_rank, r.pp_rank,
                r.engine, r.engine_member, "source" if r.sync_source else None)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines = [head] + ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
        if self.sync_groups and lay.engine_kind == "vllm" and lay.engine_adapters:
            lines.append("weight-sync groups (gloo; LoRA: the base once, then the adapters, to each vLLM engine's "
                         "first rank): " + "; ".join(
                             f"stage {s}: {[src, *(g[0] for g in self.engine_groups)]}"
                             for s, src in enumerate(self.sync_sources)))
        elif self.sync_groups and lay.engine_kind == "vllm":
            # vLLM's workers are processes of vLLM's own, not ranks: each stage's source hosts a
            # weight channel that the worker on every engine rank's GPU joins.
            lines.append("weight channels: " + "; ".join(
                f"stage {s}: rank {src} -> the vLLM workers on ranks {list(self.engine_ranks)}"
                for s, src in enumerate(self.sync_sources)))
        elif self.sync_groups:
            lines.append("weight-sync groups: " + "; ".join(
                f"stage {s}: {list(g)}" for s, g in enumerate(self.sync_groups)))
        elif self.engine_groups:
            lines.append("weight sync: within each rank (colocated: shared memory / CUDA IPC)")
        return "\n".join(lines)


def _learner_problem(lay: Layout, n: int, gpus_per_node: int) -> Optional[str]:
    """Why ``n`` learner ranks cannot hold the learner layout (None if they can)."""
    model = lay.tp * lay.pp * lay.cp
    if n <= 0:
        return "no ranks are left for the learner"
    if n % model:
        return (f"{n} learner ranks are not a multiple of learner.tp x learner.pp x learner.cp = "
                f"{lay.tp} x {lay.pp} x {lay.cp} = {model}")
    dp = n // model
    if lay.dp is not None and lay.dp != dp:
        return f"learner.dp={lay.dp} but {n} learner ranks / {model} per replica give dp={dp}"
    if n % (lay.tp * lay.ep * lay.pp):
        return (f"learner.ep={lay.ep} needs the learner ranks ({n}) to be a multiple of "
                f"tp x ep x pp = {lay.tp * lay.ep * lay.pp}")
    # TP groups are consecutive ranks; one that crosses a node boundary would run its per-layer
    # all-reduces over the network.
    for first in range(0, n, lay.tp):
        if first // gpus_per_node != (first + lay.tp - 1) // gpus_per_node:
            return (f"learner.tp={lay.tp} would split tensor-parallel group {first}-{first + lay.tp - 1} "
                    f"across nodes of {gpus_per_node} GPUs (use a TP size that divides the GPUs per node)")
    return None


def _engine_groups(first: int, lay: Layout, gpus_per_node: int) -> Tuple[Tuple[Tuple[int, ...], ...], Optional[str]]:
    groups = tuple(tuple(range(first + e * lay.engine_tp, first + (e + 1) * lay.engine_tp))
                   for e in range(lay.engines))
    for e, g in enumerate(groups):
        if g[0] // gpus_per_node != g[-1] // gpus_per_node:
            return groups, (f"engine {e} (ranks {g[0]}-{g[-1]}) would span two nodes of {gpus_per_node} GPUs; "
                            f"an engine's rollout.tp ranks must share a node")
    return groups, None


def _problem(world: int, gpus_per_node: int, lay: Layout) -> Optional[str]:
    if lay.placement not in PLACEMENTS:
        return f"rollout.placement={lay.placement!r}: choose one of {', '.join(PLACEMENTS)}"
    for name, value in (("learner.tp", lay.tp), ("learner.pp", lay.pp), ("learner.ep", lay.ep),
                        ("learner.cp", lay.cp), ("rollout.engines", lay.engines), ("rollout.tp", lay.engine_tp)):
        if value < 1:
            return f"{name}={value} must be >= 1"
    if lay.engine_kind == "embedded" and lay.engine_tp != 1:
        return "the embedded engine runs on one rank: rollout.tp must be 1 (tensor-parallel engines are vLLM's)"
    if world % gpus_per_node and world > gpus_per_node:
        return f"world size {world} is not a whole number of nodes of {gpus_per_node} GPUs"
    engine_ranks = lay.engines * lay.engine_tp
    if lay.placement == "colocated":
        if engine_ranks != world:
            return (f"colocated engines take every GPU once: rollout.engines x rollout.tp = "
                    f"{lay.engines} x {lay.engine_tp} = {engine_ranks}, the world is {world}")
        learners, first_engine = world, 0
    else:
        learners, first_engine = world - engine_ranks, world - engine_ranks
        if learners <= 0:
            return (f"rollout.engines x rollout.tp = {engine_ranks} ranks leave no learner ranks "
                    f"in a world of {world}")
    why = _learner_problem(lay, learners, gpus_per_node)
    if why:
        return why
    _, why = _engine_groups(first_engine, lay, gpus_per_node)
    return why


def _what_fits(world: int, gpus_per_node: int, lay: Layout) -> List[str]:
    """A few nearby layouts that do fit this world (changing one thing at a time)."""
    from dataclasses import replace

    tries: List[Tuple[str, Layout]] = []
    if lay.placement == "colocated":
        for etp in sorted({lay.engine_tp, 1, 2, 4, 8}):
            if world % etp == 0:
                tries.append((f"rollout.engines={world // etp} rollout.tp={etp}",
                              replace(lay, engines=world // etp, engine_tp=etp)))
    else:
        for engines in range(world - 1, 0, -1):
            tries.append((f"rollout.engines={engines}", replace(lay, engines=engines)))
    # Nearest learner shapes first (the user chose theirs for a reason).
    shapes = sorted(((tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4)),
                    key=lambda s: (abs(math.log2(s[0] / lay.tp)) + abs(math.log2(s[1] / lay.pp)), -s[0]))
    for tp, pp in shapes:
        tries.append((f"learner.tp={tp} learner.pp={pp}", replace(lay, tp=tp, pp=pp)))
    tries.append(("learner.dp unset (derived)", replace(lay, dp=None)))
    tries.append(("rollout.placement=" + ("disaggregated" if lay.placement == "colocated" else "colocated")
                  + f" rollout.engines={world // lay.engine_tp}",
                  replace(lay, placement="disaggregated" if lay.placement == "colocated" else "colocated",
                          engines=max(world // lay.engine_tp, 1))))
    fits = []
    for text, alt in tries:
        if alt != lay and _problem(world, gpus_per_node, alt) is None:
            learners = world if alt.placement == "colocated" else world - alt.engines * alt.engine_tp
            dp = learners // (alt.tp * alt.pp * alt.cp)
            fits.append(f"{text} (learner dp={dp})")
        if len(fits) == 3:
            break
    return fits


def plan_placement(world_size: int, gpus_per_node: int, layout: Layout) -> Plan:
    """Role, learner coordinates and engine membership of every rank; raises PlacementError."""
    if world_size < 1 or gpus_per_node < 1:
        raise PlacementError(f"cannot place this job on {world_size} ranks: the world size ({world_size}) and the "
                             f"GPUs per node ({gpus_per_node}) must be >= 1 (--world-size/--gpus-per-node, or "
                             "torchrun's WORLD_SIZE/LOCAL_WORLD_SIZE)")
    why = _problem(world_size, gpus_per_node, layout)
    if why:
        fits = _what_fits(world_size, gpus_per_node, layout)
        hint = ("; what would fit: " + " | ".join(fits)) if fits else "; nothing nearby fits this world size"
        raise PlacementError(f"cannot place this job on {world_size} ranks: {why}{hint}")
    lay = layout
    colocated = lay.placement == "colocated"
    n_learners = world_size if colocated else world_size - lay.engines * lay.engine_tp
    dp = n_learners // (lay.tp * lay.pp * lay.cp)
    groups, _ = _engine_groups(0 if colocated else n_learners, lay, gpus_per_node)
    per_stage = n_learners // lay.pp
    sources = () if colocated else tuple(stage * per_stage for stage in range(lay.pp))
    engine_of = {r: (e, i) for e, g in enumerate(groups) for i, r in enumerate(g)}
    infos = []
    for rank in range(world_size):
        node, local = divmod(rank, gpus_per_node)
        kw = {}
        if rank < n_learners:
            rest, tp_r = divmod(rank, lay.tp)
            rest, cp_r = divmod(rest, lay.cp)
            pp_r, dp_r = divmod(rest, dp)
            kw.update(tp_rank=tp_r, cp_rank=cp_r, dp_rank=dp_r, pp_rank=pp_r)
        if rank in engine_of:
            kw.update(engine=engine_of[rank][0], engine_member=engine_of[rank][1])
        role = "learner+engine" if colocated else ("learner" if rank < n_learners else "engine")
        infos.append(RankInfo(rank, node, local, role, sync_source=rank in sources, **kw))
    return Plan(world_size, gpus_per_node, lay, dp, tuple(range(n_learners)), groups, sources, tuple(infos))


def layout_from_config(cfg) -> Layout:
    """The Layout asked for by a RootConfig's ``learner.*`` and ``rollout.*``."""
    from .models.lora import engine_applies_adapters

    lc, rc = cfg.learner, cfg.rollout
    return Layout(tp=lc.tp, pp=lc.pp, ep=lc.ep, cp=lc.cp, dp=lc.dp, engines=rc.engines, engine_tp=rc.tp,
                  placement=rc.placement, engine_kind=rc.engine,
                  engine_adapters=engine_applies_adapters(cfg))


def plan_for(cfg, world_size: int, gpus_per_node: Optional[int] = None) -> Plan:
    return plan_placement(world_size, gpus_per_node or world_size, layout_from_config(cfg))


__all__: Sequence[str] = ("Layout", "Plan", "PlacementError", "RankInfo", "plan_placement", "plan_for",
                          "layout_from_config")
