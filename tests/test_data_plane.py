"""The data plane: trajectories packed into flat buffers and unpacked equal; each data-parallel
replica's rows are exactly the ones the learner's mini-batch and replica split gives it."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rl.learner.shares import dp_bounds
from megatron_rl.learner.shares import BatchIndex, minibatch_bounds, replica_rows
from megatron_rl.trajectory_buffers import TrajectoryBuffers, pack, unpack
from megatron_rl.types import Trajectory


def _trajectories(seed: int = 0, rows: int = 7, experts: bool = True) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        prompt, response = int(rng.integers(1, 9)), int(rng.integers(0, 12))
        routed = None
        if experts and i % 3:  # some rows recorded expert choices, some did not
            routed = rng.integers(0, 255, size=(prompt + response, 2, 4)).astype(np.uint8)
        out.append(Trajectory(
            f"p{i // 3}", i % 3, rng.integers(0, 50_000, prompt).tolist(), rng.integers(0, 50_000, response).tolist(),
            rng.standard_normal(response).astype(np.float32).astype(float).tolist(),
            rng.integers(0, 5, response).tolist(), "stop" if i % 2 else "length",
            loss_mask=rng.integers(0, 2, response).tolist(), reward=float(rng.random()),
            reward_info={"acc": float(i)}, advantage_scale=0.5 if i == 2 else 1.0,
            agent_run={"turns": 2} if i == 4 else None, routed_experts=routed))
    return out


def _same(a: Trajectory, b: Trajectory) -> None:
    for name in ("prompt_uid", "sample_index", "prompt_ids", "response_ids", "logprobs", "versions", "finish_reason",
                 "loss_mask", "reward", "reward_info", "advantage_scale", "agent_run"):
        assert getattr(a, name) == getattr(b, name), name
    if a.routed_experts is None:
        assert b.routed_experts is None
    else:
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        assert b.routed_experts.dtype == a.routed_experts.dtype


def test_packed_trajectories_unpack_equal_through_bytes() -> None:
    trajs = _trajectories()
    packed = pack(trajs)
    assert packed.arrays["logprobs"].dtype == np.float32  # float32 values: stored as such, exactly
    back = unpack(TrajectoryBuffers.from_bytes(packed.to_bytes()))
    assert len(back) == len(trajs)
    for a, b in zip(trajs, back):
        _same(a, b)
    assert packed.tokens == sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)


def test_logprobs_that_float32_would_round_travel_as_float64() -> None:
    trajs = _trajectories(experts=False)
    trajs[0] = Trajectory("x", 0, [1], [2, 3], [0.1, -1e-9], [0, 0], "stop")
    packed = pack(trajs)
    assert packed.arrays["logprobs"].dtype == np.float64
    assert unpack(TrajectoryBuffers.from_bytes(packed.to_bytes()))[0].logprobs == [0.1, -1e-9]


def test_selected_rows_unpack_as_those_rows() -> None:
    trajs = _trajectories(seed=1)
    rows = [5, 0, 3]
    back = unpack(TrajectoryBuffers.from_bytes(pack(trajs).select(rows).to_bytes()))
    for i, b in zip(rows, back):
        _same(trajs[i], b)
    assert unpack(pack([])) == []


@pytest.mark.parametrize("n, mini_batches, dp", [(16, 1, 2), (17, 2, 2), (24, 3, 4), (9, 1, 1), (10, 3, 2)])
def test_replica_rows_are_the_slices_of_each_mini_batch(n: int, mini_batches: int, dp: int) -> None:
    """Hand-made reference: the learner cuts the batch into mini-batches of ceil(n / mini_batches)
    and each mini-batch into contiguous replica slices of sizes differing by <= 1."""
    per_mini = -(-n // mini_batches)
    seen = []
    for rank in range(dp):
        rows, local = replica_rows(n, mini_batches, dp, rank)
        expected, bounds = [], []
        for start in range(0, n, per_mini):
            size = min(per_mini, n - start)
            lo, hi = dp_bounds(size, dp, rank)
            bounds.append((len(expected), len(expected) + hi - lo))
            expected.extend(range(start + lo, start + hi))
        assert rows == expected and local == bounds
        seen.extend(rows)
    assert sorted(seen) == list(range(n))  # every row trained by exactly one replica
    assert minibatch_bounds(n, mini_batches)[-1][1] == n


def test_a_mini_batch_smaller_than_the_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split over 4 data-parallel replicas"):
        replica_rows(6, 2, 4, 0)


def test_the_index_of_a_share_keeps_what_every_rank_knows_of_every_row() -> None:
    trajs = _trajectories(experts=False, rows=6)
    index = BatchIndex.of(trajs, [(0, 1, 2), (3, 4, 5)])
    share = index.share(1, 2, 1)
    assert share.rows == (3, 4, 5) and share.minibatches == ((0, 3),) and not share.whole
    assert share.rewards == tuple(t.reward for t in trajs) and share.groups == index.groups
    assert index.whole and index.share(1, 1, 0).rows == tuple(range(6))


# ---------------------------------------------------------------------------- through a world
class _RecordingWorker:
    """A learner rank's side of the data plane: what it received, per step."""

    def __init__(self, rank: int, ranks: int, mini_batches: int):
        from types import SimpleNamespace

        self.rank, self.ranks = rank, ranks
        self.cfg = SimpleNamespace(learner=SimpleNamespace(mini_batches=mini_batches))
        self.received: list = []

    def replica(self):
        return self.rank, self.ranks

    def receive_rows(self, buffers):
        from megatron_rl.trajectory_buffers import unpack

        self.bytes = sum(a.nbytes for a in buffers.arrays.values())
        return unpack(buffers)

    def train_share(self, trajs, index, version, lr):
        self.received.append((list(index.rows), index.minibatches, [(t.prompt_uid, t.sample_index, t.response_ids,
                                                                    t.logprobs) for t in trajs], version, lr))
        return {"rows": float(len(trajs))}


def _world_rank(rank: int, ranks: int, port: int, mini_batches: int, out) -> None:
    import torch.distributed as dist

    from megatron_rl.learner.group import LearnerGroup, serve_learner

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    worker = _RecordingWorker(rank, ranks, mini_batches)
    if rank == 0:
        group = LearnerGroup(worker, dist.group.WORLD, range(ranks))
        trajs = _trajectories(seed=2, rows=12, experts=True)
        metrics = group.train([trajs[i:i + 3] for i in range(0, 12, 3)], 7, 0.5)
        group.close()
        out.put(("metrics", metrics["data/share_bytes_max"], metrics["data/batch_bytes"]))
    else:
        serve_learner(worker, dist.group.WORLD)
    out.put((rank, worker.received))
    dist.destroy_process_group()


def test_in_a_world_each_learner_rank_receives_its_replicas_rows_and_no_others() -> None:
    """Three replicas, two mini-batches: each rank's share holds exactly the rows the learner's
    split gives it (equal to the driver's trajectories) and a third of the batch's bytes."""
    import torch.multiprocessing as mp

    from megatron_rl.learner.parallel import free_port

    ranks, mini_batches = 3, 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_world_rank, args=(r, ranks, port, mini_batches, out), daemon=True) for r in range(ranks)]
    for proc in procs:
        proc.start()
    got = {}
    try:
        for _ in range(ranks + 1):  # each rank's record, and the driver's figures
            message = out.get(timeout=120)
            got[message[0]] = message[1:]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    trajs = _trajectories(seed=2, rows=12, experts=True)
    for rank in range(ranks):
        (received,) = got[rank]
        (rows, bounds, rows_seen, version, lr), = received
        expected_rows, expected_bounds = replica_rows(12, mini_batches, ranks, rank)
        assert rows == expected_rows and list(bounds) == expected_bounds and (version, lr) == (7, 0.5)
        assert rows_seen == [(trajs[i].prompt_uid, trajs[i].sample_index, trajs[i].response_ids, trajs[i].logprobs)
                             for i in rows]
    share_bytes, batch_bytes = got["metrics"]
    assert share_bytes < 0.5 * batch_bytes  # each rank got its third of the rows, not the batch
