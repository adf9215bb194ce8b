"""The wire format of a weight push, over any one-to-many broadcast ``Link``.

A push is, per pipeline stage and in stage order, a run of buckets; each bucket is a header
(version, names, shapes, dtypes, byte count) broadcast as an object, then one flat byte buffer
broadcast as a tensor; an empty header (None) ends the stage. Buckets bound the memory a push
needs beyond the model (one bucket of gathered tensors on the source, one on each receiver as it
arrives) and let the transfer overlap the gathering of the next tensors.

Only torch here: this module is imported inside vLLM's worker processes too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

DEFAULT_BUCKET_BYTES = 64 << 20


class Link(Protocol):
    """One sender (the root) and its receivers. Every member calls each method in the same order;
    the root's argument is what the others get."""

    def broadcast_object(self, obj: Any) -> Any: ...

    def broadcast_tensor(self, tensor: torch.Tensor) -> None: ...


class WorldLink:
    """A link over a group of the torchrun world, rooted at global rank ``src``."""

    def __init__(self, group: Any, src: int):
        self.group, self.src = group, src

    def broadcast_object(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, src=self.src, group=self.group)


@dataclass
class SyncStats:
    version: int
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


def buckets(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    bucket: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def pack(bucket: List[Tuple[str, torch.Tensor]], version: int) -> Tuple[Dict[str, Any], torch.Tensor]:
    # Bytes, not values: one buffer carries any mix of dtypes bit for bit.
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    header = {
        "version": version,
        "names": [n for n, _ in bucket],
        "shapes": [tuple(t.shape) for _, t in bucket],
        "dtypes": [t.dtype for _, t in bucket],
        "nbytes": flat.numel(),
    }
    return header, flat


def unpack(header: Dict[str, Any], flat: torch.Tensor) -> Dict[str, torch.Tensor]:
    out = {}
    offset = 0
    for name, shape, dtype in zip(header["names"], header["shapes"], header["dtypes"]):
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        # Cloned before the view: a slice at an odd byte offset cannot be viewed as a wider dtype.
        out[name] = flat[offset : offset + n].clone().view(dtype).reshape(shape)
        offset += n
    return out


def send_stage(link: Optional[Link], named: Iterable[Tuple[str, torch.Tensor]], version: int,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[SyncStats]:
    """Send one stage's tensors over ``link`` (the root's side). ``link`` None: this rank only
    walks ``named`` (it helps gather: the iterator holds collectives) and sends nothing."""
    stats = SyncStats(version)
    start = time.perf_counter()
    for bucket in buckets(named, bucket_bytes):
        if link is None:
            continue
        header, flat = pack(bucket, version)
        link.broadcast_object(header)
        link.broadcast_tensor(flat)
        stats.bytes += flat.numel()
        stats.tensors += len(bucket)
        stats.buckets += 1
    if link is None:
        return None
    link.broadcast_object(None)  # end of this stage
    stats.seconds = time.perf_counter() - start
    return stats


def receive_stages(links: Sequence[Link], device: Optional[torch.device], stats: SyncStats
                   ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Receiver's side: every stage's tensors in the order sent, as buckets arrive (a consumer
    can load each bucket before the next is on the wire). ``stats`` is filled in as it goes."""
    start = time.perf_counter()
    for link in links:
        while True:
            header = link.broadcast_object(None)
            if header is None:
                break
            stats.version = header["version"]
            flat = torch.empty(header["nbytes"], dtype=torch.uint8, device=device)
            link.broadcast_tensor(flat)
            stats.bytes += flat.numel()
            stats.tensors += len(header["names"])
            stats.buckets += 1
            yield from unpack(header, flat).items()
            stats.seconds = time.perf_counter() - start
    stats.seconds = time.perf_counter() - start


def receive_all(links: Sequence[Link], device: Optional[torch.device] = None
                ) -> Tuple[int, Dict[str, torch.Tensor], SyncStats]:
    """Every stage's tensors (HF names), the version they carry, and timing."""
    stats = SyncStats(-1)
    out = dict(receive_stages(links, device, stats))
    return stats.version, out, stats
