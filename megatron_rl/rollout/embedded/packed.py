"""Weights for an engine in another process, packed into one flat buffer per dtype.

torch.multiprocessing shares a tensor's storage with the receiving process instead of copying it
through the pipe: CPU storage as a shared-memory file, CUDA storage as a CUDA IPC handle that the
child maps. One buffer per dtype means one shared segment (one IPC handle on a GPU) for the whole
model instead of one per parameter, and on a GPU the weights never leave device memory: the
packing is a device-to-device copy (onto the engine's GPU when it has its own), and the child
copies out of the mapped buffer into its model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch


@dataclass
class PackedWeights:
    buffers: Dict[str, torch.Tensor]  # dtype name -> flat 1-D buffer
    index: List[Tuple[str, str, int, Tuple[int, ...]]]  # (name, dtype name, offset, shape)

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name, tensor) pairs: views into the buffers, valid while this object lives."""
        for name, dtype, offset, shape in self.index:
            yield name, self.buffers[dtype][offset : offset + math.prod(shape)].view(shape)

    @property
    def on_cpu(self) -> bool:
        """Shared-memory buffers, which both processes can keep and reuse."""
        return all(b.device.type == "cpu" for b in self.buffers.values())

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def pack_weights(named_tensors: Iterable[Tuple[str, torch.Tensor]], device: Optional[torch.device] = None,
                 into: Optional[PackedWeights] = None) -> PackedWeights:
    """Copy ``named_tensors`` into fresh flat buffers on ``device`` (default: where they are), or
    into the buffers of ``into`` when they have the same layout (names, dtypes, shapes)."""
    tensors = [(name, t.detach()) for name, t in named_tensors]
    sizes: Dict[str, int] = {}
    index: List[Tuple[str, str, int, Tuple[int, ...]]] = []
    for name, t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        index.append((name, dtype, sizes.get(dtype, 0), tuple(t.shape)))
        sizes[dtype] = sizes.get(dtype, 0) + t.numel()
    if into is not None and into.index == index:
        buffers = into.buffers
        device = next(iter(buffers.values())).device if buffers else torch.device("cpu")
    else:
        if device is None:
            device = tensors[0][1].device if tensors else torch.device("cpu")
        buffers = {dtype: torch.empty(n, dtype=getattr(torch, dtype), device=device) for dtype, n in sizes.items()}
        if device.type == "cpu":
            # In shared memory from the start: sending it then copies nothing more.
            buffers = {dtype: b.share_memory_() for dtype, b in buffers.items()}
    for (name, t), (_, dtype, offset, _) in zip(tensors, index):
        buffers[dtype][offset : offset + t.numel()].copy_(t.reshape(-1), non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the child reads the buffer as soon as it gets the handle
    return PackedWeights(buffers, index)
