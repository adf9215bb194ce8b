"""The driver's handle on every learner rank, and the loop the other learner ranks run.

A training step's trajectories do not ride on the announcement: ``LearnerGroup.train`` announces
what every rank needs of the whole batch (``BatchIndex``: a few numbers per row) and sends each
rank only its data-parallel replica's rows, packed into one flat buffer (trajectory_buffers.py),
point to point over the control group. A replica's TP/PP ranks each receive the share once.

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
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..trajectory_buffers import TrajectoryBuffers, pack_bytes
from ..types import Trajectory
from .shares import BatchIndex, index_groups

logger = logging.getLogger(__name__)

DRIVER = 0
_STOP = "__stop__"
_LAYOUT = "__layout__"    # every learner rank tells the driver its data-parallel replica
_SHARES = "__shares__"    # a call whose first argument is this rank's share of a batch


class LearnerRanksFailed(RuntimeError):
    """A call across the learner ranks failed: one of them died, raised, or timed out."""


class LearnerGroup:
    def __init__(self, worker, control_group: Optional[dist.ProcessGroup] = None, ranks: Sequence[int] = (0,)):
        self.worker = worker
        self.control_group = control_group
        self.ranks = tuple(ranks)
        self._replicas: Optional[Dict[int, tuple]] = None

    def call(self, name: str, *args: Any) -> Any:
        if self.control_group is None:
            return getattr(self.worker, name)(*args)
        try:
            dist.broadcast_object_list([(name, args)], src=DRIVER, group=self.control_group)
        except RuntimeError as err:  # torch's DistBackendError (a dead or silent peer) is one
            raise self._failed(name, err) from err
        return self._run(name, *args)

    def train(self, groups: Sequence[Sequence[Trajectory]], version: int, lr: float,
              teachers: Optional[List[str]] = None) -> Dict[str, float]:
        """``LearnerWorker.train_share`` on every learner rank, each with its replica's rows of
        these groups (in one process: ``LearnerWorker.train``). Adds the data plane's figures:
        the largest share a rank received (bytes) and the driver's seconds packing and sending."""
        if self.control_group is None:
            return self.worker.train(groups, version, lr, teachers)
        start = time.perf_counter()
        trajs, index = index_groups(groups, teachers)
        replicas = self.replicas()
        dp = replicas[DRIVER][1]
        mini_batches = self.worker.cfg.learner.mini_batches
        shares = [index.share(mini_batches, dp, r) for r in range(dp)]
        payloads = [pack_bytes([trajs[i] for i in share.rows]) for share in shares]
        sizes = {rank: int(payloads[replica].size) for rank, (replica, _) in replicas.items()}
        try:
            dist.broadcast_object_list([(_SHARES, ("train_share", index, sizes, (version, lr)))], src=DRIVER,
                                       group=self.control_group)
            sends = [dist.isend(torch.from_numpy(payloads[replica]), dst=rank, group=self.control_group)
                     for rank, (replica, _) in replicas.items() if rank != DRIVER]
            for request in sends:
                request.wait()
        except RuntimeError as err:
            raise self._failed("sending the batch", err) from err
        sent_s = time.perf_counter() - start
        mine = shares[replicas[DRIVER][0]]
        metrics = self._run("train_share", [trajs[i] for i in mine.rows], mine, version, lr)
        metrics.update({"data/share_bytes_max": float(max(sizes.values())),
                        "data/batch_bytes": float(sum(p.size for p in payloads)), "data/send_s": sent_s})
        return metrics

    def replicas(self) -> Dict[int, tuple]:
        """Each learner rank's (data-parallel replica, replica count), asked once."""
        if self._replicas is None:
            dist.broadcast_object_list([(_LAYOUT, ())], src=DRIVER, group=self.control_group)
            self._replicas = _gather_layout(self.worker, self.control_group)
        return self._replicas

    def _run(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.worker, name)(*args)
        except LearnerRanksFailed:
            raise
        except RuntimeError as err:  # torch's DistBackendError (a dead or silent peer) is one
            raise self._failed(name, err) from err

    def _failed(self, what: str, err: BaseException) -> LearnerRanksFailed:
        """The one-line error of a call (or a send) that failed among the learner ranks."""
        return LearnerRanksFailed(f"{what} failed among learner ranks {list(self.ranks)}: {err}".strip()
                                  + " (a rank died or timed out: see its log)")

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
        if name == _LAYOUT:
            _gather_layout(worker, control_group)
        elif name == _SHARES:
            name, index, sizes, rest = args
            trajs, share = _receive_share(worker, index, sizes[dist.get_rank()], control_group)
            getattr(worker, name)(trajs, share, *rest)
        else:
            getattr(worker, name)(*args)


def _gather_layout(worker, control_group: dist.ProcessGroup) -> Dict[int, tuple]:
    """Every learner rank's (data-parallel replica, replica count), on every learner rank."""
    rank, size = worker.replica()
    everyone: List = [None] * dist.get_world_size(group=control_group)
    dist.all_gather_object(everyone, (dist.get_rank(), rank, size), group=control_group)
    return {global_rank: (replica, count) for global_rank, replica, count in everyone}


def _receive_share(worker, index: BatchIndex, size: int, control_group: dist.ProcessGroup) -> tuple:
    """This rank's rows of the announced batch, from the driver: (trajectories, its index)."""
    data = np.empty(size, dtype=np.uint8)
    dist.recv(torch.from_numpy(data), src=DRIVER, group=control_group)
    rank, dp = worker.replica()
    share = index.share(worker.cfg.learner.mini_batches, dp, rank)
    return worker.receive_rows(TrajectoryBuffers.from_bytes(data)), share
