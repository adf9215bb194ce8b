"""Weight channels: a process group of their own between a weight source and the processes that
load weights into an engine, outside torchrun's world.

vLLM's workers live in processes that vLLM spawns with a torch.distributed world of their own,
so they cannot join the job's groups. A channel is made from a ``TCPStore`` that the source
hosts (its address travels to the engine, which hands it to its workers) and a process group
built directly on it: gloo on CPUs, NCCL on GPUs (tensors stay on the device; no copy through host
memory). Member 0 is the source; the receivers are members 1..n. The group is made on first use
(a collective: the source's first push and the receivers' first receive meet in it), so nothing
waits at start-up for engines still loading.

Only torch here: this module is imported inside vLLM's worker processes too.
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ChannelAddress:
    """Where a channel's store listens and how many members the channel has (source included)."""
    host: str
    port: int
    size: int
    backend: str = "gloo"  # gloo | nccl
    name: str = "weights"

    def as_tuple(self) -> tuple:
        """Plain values, as an address travels (an all-gather, vLLM's msgpack RPC arguments)."""
        return (self.host, self.port, self.size, self.backend, self.name)


class ChannelHost:
    """The source's side: hosts the store now (so the address can be handed out) and makes the
    group on first use."""

    def __init__(self, host: str, receivers: int, backend: str = "gloo", name: str = "weights",
                 timeout_s: float = 1800.0):
        self._timeout = timedelta(seconds=timeout_s)
        # Port 0: the OS picks a free one.
        self._store = dist.TCPStore(host, 0, receivers + 1, is_master=True, timeout=self._timeout,
                                    wait_for_workers=False)
        self.address = ChannelAddress(host, self._store.port, receivers + 1, backend, name)
        self._channel: Optional[WeightChannel] = None

    def channel(self) -> "WeightChannel":
        if self._channel is None:
            self._channel = WeightChannel(self.address, 0, self._timeout.total_seconds(), store=self._store)
        return self._channel


class WeightChannel:
    """A member's side of a channel: ``broadcast_object`` / ``broadcast_tensor`` from member 0
    (the ``Link`` of ``buckets.py``). The group is made on the first broadcast."""

    def __init__(self, address: ChannelAddress, rank: int, timeout_s: float = 1800.0, store=None):
        self.address, self.rank = address, rank
        self._timeout = timedelta(seconds=timeout_s)
        self._store = store
        self._group = None
        self._lock = threading.Lock()

    @property
    def device(self) -> Optional[torch.device]:
        return torch.device("cuda", torch.cuda.current_device()) if self.address.backend == "nccl" else None

    def _pg(self):
        with self._lock:
            if self._group is None:
                a = self.address
                if self._store is None:
                    self._store = dist.TCPStore(a.host, a.port, a.size, is_master=False, timeout=self._timeout)
                store = dist.PrefixStore(a.name, self._store)
                if a.backend == "nccl":
                    self._group = dist.ProcessGroupNCCL(store, self.rank, a.size, timeout=self._timeout)
                else:
                    self._group = dist.ProcessGroupGloo(store, self.rank, a.size, self._timeout)
            return self._group

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        if self.rank == 0 and self.device is not None and tensor.device != self.device:
            # A host that received the weights into host memory (a vLLM engine rank under LoRA)
            # sends over NCCL from its GPU.
            tensor = tensor.to(self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg().broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: Any) -> Any:
        """Pickled into bytes: a length, then the bytes."""
        device = self.device
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
            size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
            self.broadcast_tensor(size)
            self.broadcast_tensor(data)
            return obj
        size = torch.zeros(1, dtype=torch.int64, device=device)
        self.broadcast_tensor(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self.broadcast_tensor(data)
        return pickle.loads(data.cpu().numpy().tobytes())
