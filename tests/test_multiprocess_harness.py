"""The multi-process harness itself: values come back per rank, a raising rank fails the test with
its traceback, a hang fails within the timeout and leaves no rank behind."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from rank_harness import RankFailed, RankTimeout, run_ranks


def _all_reduce_rank(offset: int):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "env_rank": int(os.environ["RANK"]), "sum": t.item(),
            "threads": torch.get_num_threads(), "pid": os.getpid()}


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 waits for a peer that is gone: it must be killed, not waited for
    return "unreachable"


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(600)
    return os.getpid()


def test_values_come_back_by_rank():
    out = run_ranks(_all_reduce_rank, 3, args=(10,), timeout_s=120)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert [o["env_rank"] for o in out] == [0, 1, 2]
    assert all(o["sum"] == 33.0 for o in out)  # (0+10) + (1+10) + (2+10)
    assert all(o["threads"] == 1 for o in out)
    assert len({o["pid"] for o in out}) == 3


def test_a_raising_rank_fails_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run_ranks(_raise_on_rank_one, 2, timeout_s=120)
    text = str(err.value)
    assert "rank 1 of 2 raised" in text
    assert "ValueError: boom from rank one" in text and "_raise_on_rank_one" in text
    assert time.monotonic() - start < 60  # did not wait for the stuck barrier's timeout


def test_a_hang_fails_within_the_timeout_and_kills_every_rank():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0\] did not finish within 20 s"):
        run_ranks(_hang_on_rank_zero, 2, timeout_s=20)
    assert time.monotonic() - start < 40
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("rank")]


def _device_of_rank():
    return torch.zeros(2).device.type


def test_backend_comes_from_the_environment(monkeypatch):
    from rank_harness import BACKEND_ENV, backend

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend() == "gloo"  # the CPU default CI runs
    monkeypatch.setenv(BACKEND_ENV, "NCCL")
    assert backend() == "nccl"
    monkeypatch.setenv(BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="MEGATRON_RL_TEST_BACKEND='mpi'"):
        backend()


def test_nccl_skips_when_there_are_fewer_gpus_than_ranks(monkeypatch):
    from rank_harness import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "nccl")
    need = torch.cuda.device_count() + 1
    with pytest.raises(pytest.skip.Exception, match=f"{need} ranks need {need} GPUs"):
        run_ranks(_device_of_rank, need, timeout_s=60)


def test_tensors_come_back_on_the_cpu():
    from rank_harness import _to_cpu

    value = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "x"}
    out = _to_cpu(value)
    assert out["a"][0].device.type == "cpu" and isinstance(out["a"][1], tuple) and out["a"][1][1] == 3
    assert out["b"] == "x"
