"""Megatron's parallel_state over a *subset* of the torchrun world.

megatron-core 0.16.1's ``initialize_model_parallel`` lays its groups out over the whole default
world (``torch.distributed.get_world_size()``, ranks from 0; ``RankGenerator(rank_offset=0)`` is
fixed) and creates each group with ``new_group``, which every rank of the world must call. A
world of learners *and* rollout engines therefore needs two things:

- the learner layout computed over ranks ``[0, L)`` only: the call runs with ``get_world_size()``
  reading ``L`` (so the learners must be the world's first ranks; the planner puts them there);
- every rank of the world making the same ``new_group`` calls in the same order: engine ranks
  run the same initialisation too, as non-members of every group, and then drop the state it
  left behind (their model needs a layout of its own).

Engines are laid out the same way over ``[L, N)``: ranks are shifted by ``L`` on the way into
``new_group``, and the learners run that pass as non-members. Engines are single pipeline stages,
so the one kind of absolute rank list Megatron keeps that this shift does not fix (pipeline and
embedding rank lists) is never used there.
"""

from __future__ import annotations

import contextlib
import types
from datetime import timedelta
from typing import Dict, Iterator, Optional

import torch.distributed as dist

from ..process_groups import new_groups


def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def _snapshot() -> Dict[str, object]:
    """parallel_state's module globals (lists copied: Megatron appends to one of them)."""
    ps = _parallel_state()
    out = {}
    for key, value in vars(ps).items():
        if not key.startswith("_") or key.startswith("__") or callable(value) or isinstance(value, types.ModuleType):
            continue
        out[key] = list(value) if isinstance(value, list) else value
    return out


def _restore(saved: Dict[str, object]) -> None:
    ps = _parallel_state()
    for key, value in saved.items():
        setattr(ps, key, value)


@contextlib.contextmanager
def _world_view(first: int, size: int, member: bool) -> Iterator[None]:
    """Make ``torch.distributed`` look like a world of ranks ``[first, first + size)`` to the
    code inside: world size ``size``, this rank relative to ``first`` (or ``size``, a rank in no
    group, when not a member), ranks shifted by ``first`` on their way into ``new_group``."""
    real_size, real_rank, real_new_group = dist.get_world_size, dist.get_rank, dist.new_group
    me = real_rank()

    def get_world_size(group=None):
        return size if group is None else real_size(group)

    def get_rank(group=None):
        if group is not None:
            return real_rank(group)
        return me - first if member else size

    def new_group(ranks=None, *args, **kwargs):
        if ranks is not None:
            ranks = [r + first for r in ranks]
        return real_new_group(ranks, *args, **kwargs)

    dist.get_world_size, dist.get_rank, dist.new_group = get_world_size, get_rank, new_group
    try:
        yield
    finally:
        dist.get_world_size, dist.get_rank, dist.new_group = real_size, real_rank, real_new_group


def _initialize(tp: int, pp: int, ep: int, cp: int, timeout: Optional[timedelta] = None) -> None:
    minutes = {} if timeout is None else {"distributed_timeout_minutes": max(1, round(timeout.total_seconds() / 60))}
    _parallel_state().initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, context_parallel_size=cp, **minutes)


# Collectives Megatron calls on the default group (``group=None``); e.g. megatron-core 0.16.1's
# ``get_megatron_optimizer`` all-gathers parameter-group keys over the whole world.
_DEFAULT_GROUP_CALLS = ("all_gather_object", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                        "broadcast_object_list", "barrier", "gather_object", "reduce", "reduce_scatter_tensor",
                        "scatter_object_list")
_redirected: Optional[dist.ProcessGroup] = None


def redirect_default_group(group: dist.ProcessGroup) -> None:
    """From now on, in this process, ``torch.distributed.<collective>(..., group=None)`` and
    ``torch.distributed.get_world_size()`` mean ``group``: Megatron on a learner rank then sees a
    world of learners. Code that means the whole world passes ``group=dist.group.WORLD``.
    (torch's own internals call its module functions directly and are unaffected.)"""
    import functools
    import inspect

    global _redirected
    if _redirected is not None:
        raise RuntimeError("the default group is already redirected")
    _redirected = group
    for name in _DEFAULT_GROUP_CALLS:
        original = getattr(dist, name)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def call(*args, _original=original, _signature=signature, **kwargs):
            bound = _signature.bind_partial(*args, **kwargs)
            if bound.arguments.get("group") is None:
                bound.arguments["group"] = _redirected
            return _original(*bound.args, **bound.kwargs)

        setattr(dist, name, call)
    real_size = dist.get_world_size
    dist.get_world_size = lambda group=None: real_size(_redirected if group is None else group)


def init_split_parallel_state(num_learner_ranks: int, tp: int, pp: int, ep: int = 1, cp: int = 1,
                              engine_tp: int = 1, seed: int = 0, timeout: Optional[timedelta] = None) -> str:
    """Collective over the whole world: Megatron's parallel_state for the learner layout on ranks
    ``[0, num_learner_ranks)`` and for engines of ``engine_tp`` ranks on the rest. Returns this
    rank's role, ``"learner"`` or ``"engine"``. ``torch.distributed`` must be initialised.

    On learner ranks the default group is redirected to the learners (``redirect_default_group``)
    when engines share the world. ``timeout``: of every group made (Megatron's in whole minutes)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from ..models.cpu_patches import apply_cpu_patches

    apply_cpu_patches()
    ps = _parallel_state()
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 0 < num_learner_ranks <= world:
        raise ValueError(f"{num_learner_ranks} learner ranks in a world of {world}")
    if ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel_state is already initialised")
    learner = rank < num_learner_ranks
    engines = world - num_learner_ranks
    kept: Optional[Dict[str, object]] = None
    passes = [(0, num_learner_ranks, learner, dict(tp=tp, pp=pp, ep=ep, cp=cp))]
    if engines:
        passes.append((num_learner_ranks, engines, not learner, dict(tp=engine_tp, pp=1, ep=1, cp=1)))
    for first, size, member, layout in passes:
        before = _snapshot()
        with _world_view(first, size, member):
            _initialize(**layout, timeout=timeout)
        if member:
            kept = _snapshot()
        _restore(before)
    assert kept is not None
    _restore(kept)
    # Every rank creates both groups (new_group is collective over the world); each keeps its own.
    learner_group, engine_group = new_groups([range(num_learner_ranks), range(num_learner_ranks, world)],
                                             timeout=timeout)
    if learner and engines:
        redirect_default_group(learner_group)
    model_parallel_cuda_manual_seed(seed)
    return "learner" if learner else "engine"
