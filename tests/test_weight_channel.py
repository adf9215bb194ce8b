"""Weight channels carry a push bit for bit to processes outside the job's torch.distributed world
(as vLLM's workers are): two receivers of another world join the channels of two pipeline
stages, made on first use, and get every tensor, whatever its dtype, in stage order."""

import io
import multiprocessing as mp
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.weights.buckets import receive_all, send_stage
from megatron_rl.weights.channel import ChannelAddress, ChannelHost, WeightChannel


def _stage(stage: int):
    gen = torch.Generator().manual_seed(stage)
    return {f"model.layers.{stage}.w": torch.randn(33, 17, generator=gen),
            f"model.layers.{stage}.b": torch.randn(5, generator=gen).to(torch.bfloat16),
            f"model.layers.{stage}.i": torch.arange(7, dtype=torch.int64)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receiver(member: int, addresses, port: int, out) -> None:
    # A world of its own (as a vLLM worker has), which the channels must not disturb.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    links = [WeightChannel(ChannelAddress(*a), member, timeout_s=60) for a in addresses]
    version, tensors, stats = receive_all(links)
    buffer = io.BytesIO()  # bytes, not shared tensors: this process exits before they are read
    torch.save(tensors, buffer)
    out.put((member, version, buffer.getvalue(), stats.buckets))


def test_a_push_reaches_processes_of_another_world_bit_for_bit():
    hosts = [ChannelHost("127.0.0.1", receivers=2, name=f"weights-stage{s}", timeout_s=60) for s in range(2)]
    addresses = [h.address.as_tuple() for h in hosts]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(m, addresses, _free_port(), out)) for m in (1, 2)]
    for proc in procs:
        proc.start()
    try:
        for stage, host in enumerate(hosts):  # stage by stage, as the receivers take them
            stats = send_stage(host.channel(), _stage(stage).items(), version=7, bucket_bytes=600)
            assert stats.tensors == 3 and stats.buckets >= 2  # small buckets: several per stage
        got = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    want = {**_stage(0), **_stage(1)}
    for member, version, saved, buckets in got:
        tensors = torch.load(io.BytesIO(saved))
        assert version == 7 and buckets >= 4
        assert list(tensors) == list(want)  # stage order, then bucket order
        for name, tensor in want.items():
            assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), (member, name)
