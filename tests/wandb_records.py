"""Read a W&B run file (``run-<id>.wandb``, what an offline run writes) back with W&B's own record
definitions (``wandb.proto.wandb_internal_pb2.Record``). wandb 0.31 ships no Python reader of the
file (its writer is the Go ``wandb-core``), so the framing, LevelDB's log format as W&B writes it,
is read here: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of chunks,
each a CRC-32 of its type and data, a 2-byte length, a type (full, first, middle, last) and data."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Dict, Iterator, List

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator["object"]:
    """Every Record in the file, in order (checks each chunk's CRC)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data.startswith(HEADER), f"{path} is not a W&B run file"
    pos, pending = len(HEADER), b""
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:  # the block's trailer: zeros
            pos += left_in_block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        if kind == 0 and length == 0:  # zero padding at the end of a file written so far
            break
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: chunk at {pos} has a bad CRC"
        pos += CHUNK_HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def history(path: Path) -> List[Dict[str, object]]:
    """The rows ``run.log`` wrote, as dicts of their values (W&B's internal keys, ``_step`` ...,
    included)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def config(path: Path) -> Dict[str, object]:
    """The run's config: the run record's and every update after it, in order, merged (top-level keys)."""
    out: Dict[str, object] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = record.config.update if kind == "config" else record.run.config.update if kind == "run" else []
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_ids(path: Path) -> List[str]:
    return [r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run"]
