"""Process groups of a torch.distributed world, made the same way by every layer that needs its
own (the launcher's control and weight-sync groups, the weights' channels)."""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence

import torch.distributed as dist


def new_groups(rank_lists: Sequence[Sequence[int]], backend: Optional[str] = None,
               timeout: Optional[timedelta] = None) -> List[Optional[dist.ProcessGroup]]:
    """Collective over the whole world: one group per rank list, in order (None where this rank
    is not a member)."""
    me = dist.get_rank()
    options = {k: v for k, v in (("backend", backend), ("timeout", timeout)) if v is not None}
    out: List[Optional[dist.ProcessGroup]] = []
    for ranks in rank_lists:
        ranks = list(ranks)
        if not ranks:
            out.append(None)
            continue
        group = dist.new_group(ranks, **options)
        out.append(group if me in ranks else None)
    return out
