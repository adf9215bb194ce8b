"""The driver's handle on every learner rank, and the loop the other learner ranks run.

``LearnerGroup.call(name, *args)`` announces the call on the control group (a gloo group of the
learner ranks, so the driver's small messages never queue behind NCCL work), then runs
``LearnerWorker.<name>(*args)`` here; every other learner rank, in ``serve_learner``, receives the
announcement and runs the same call, so the collectives inside meet. The driver makes every call
from one thread (the trainer's learner thread): the order of calls is the order of the
announcements. A call that fails on a collective (a rank died, or did not answer within the
world's timeout) raises ``LearnerRanksFailed`` naming the call and the ranks.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch.distributed as dist

logger = logging.getLogger(__name__)

DRIVER = 0
_STOP = "__stop__"


class LearnerRanksFailed(RuntimeError):
    """A call across the learner ranks failed: one of them died, raised, or timed out."""


class LearnerGroup:
    def __init__(self, worker, control_group: Optional[dist.ProcessGroup] = None, ranks: Sequence[int] = (0,)):
        self.worker = worker
        self.control_group = control_group
        self.ranks = tuple(ranks)

    def call(self, name: str, *args: Any) -> Any:
        if self.control_group is None:
            return getattr(self.worker, name)(*args)
        try:
            dist.broadcast_object_list([(name, args)], src=DRIVER, group=self.control_group)
            return getattr(self.worker, name)(*args)
        except LearnerRanksFailed:
            raise
        except RuntimeError as err:  # torch's DistBackendError (a dead or silent peer) is one
            raise LearnerRanksFailed(f"{name} failed among learner ranks {list(self.ranks)}: {err}".strip()
                                     + " (a rank died or timed out: see its log)") from err

    def close(self) -> None:
        """Let the other learner ranks leave ``serve_learner``."""
        if self.control_group is not None:
            try:
                dist.broadcast_object_list([(_STOP, ())], src=DRIVER, group=self.control_group)
            except RuntimeError as err:
                logger.warning("could not tell the learner ranks to stop: %s", err)
            self.control_group = None


def serve_learner(worker, control_group: dist.ProcessGroup) -> None:
    """A non-driver learner rank: run each call the driver announces until it says stop."""
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=DRIVER, group=control_group)
        name, args = box[0]
        if name == _STOP:
            return
        getattr(worker, name)(*args)
