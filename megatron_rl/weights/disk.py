"""Disk fallback for weight sync: when engines cannot join a process group with the learner (a
separate job, a different launcher, a crashed and restarted engine), each pipeline stage's source
writes its HF-named full tensors as safetensors shards under ``<dir>/v<version>/`` and an engine
reads them back once every stage's manifest is there.

A stage's manifest (``stage<s>.json``: its shard files and tensor names) is written after its
shards and renamed into place, so a reader never sees a stage half written. Shards are cut at
``bucket_bytes`` like the broadcast buckets.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ..config.schema import ModelConfig
from .buckets import DEFAULT_BUCKET_BYTES, SyncStats, buckets
from .sync import _hf_tensors


def version_dir(directory: Path, version: int) -> Path:
    return Path(directory) / f"v{version}"


def write_stage(named: Iterator[Tuple[str, torch.Tensor]], directory: Path, version: int, stage: int,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncStats:
    """Write one stage's tensors as shards plus its manifest (last, atomically)."""
    from safetensors.torch import save_file

    out = version_dir(directory, version)
    out.mkdir(parents=True, exist_ok=True)
    stats = SyncStats(version)
    start = time.perf_counter()
    shards: List[Dict[str, object]] = []
    for k, bucket in enumerate(buckets(named, bucket_bytes)):
        name = f"stage{stage}-{k:05d}.safetensors"
        save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, str(out / name), metadata={"version": str(version)})
        shards.append({"file": name, "names": [n for n, _ in bucket]})
        stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        stats.tensors += len(bucket)
        stats.buckets += 1
    tmp = out / f".stage{stage}.json.tmp"
    tmp.write_text(json.dumps({"version": version, "stage": stage, "shards": shards}))
    os.replace(tmp, out / f"stage{stage}.json")
    stats.seconds = time.perf_counter() - start
    return stats


def send_weights_to_disk(module: torch.nn.Module, model_cfg: ModelConfig, directory: Path, version: int,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[SyncStats]:
    """Learner side; every learner rank calls it (the TP/EP gathers need all of them). The stage's
    TP rank 0 of data-parallel replica 0 writes."""
    from megatron.core import parallel_state as ps

    named = _hf_tensors(module, model_cfg)
    writer = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
              and ps.get_context_parallel_rank() == 0)
    if not writer:
        for _ in named:  # take part in the gathers
            pass
        return None
    return write_stage(named, directory, version, ps.get_pipeline_model_parallel_rank(), bucket_bytes)


def read_weights(directory: Path, version: int, stages: int, timeout_s: float = 600.0,
                 poll_s: float = 0.05) -> Tuple[Dict[str, torch.Tensor], SyncStats]:
    """Engine side: wait for every stage's manifest of ``version``, then load all shards."""
    from safetensors.torch import load_file

    out = version_dir(directory, version)
    manifests = [out / f"stage{s}.json" for s in range(stages)]
    deadline = time.monotonic() + timeout_s
    while not all(m.exists() for m in manifests):
        if time.monotonic() > deadline:
            missing = [m.name for m in manifests if not m.exists()]
            raise TimeoutError(f"weights v{version} under {out}: {missing} not written within {timeout_s:.0f} s")
        time.sleep(poll_s)
    stats = SyncStats(version)
    start = time.perf_counter()
    tensors: Dict[str, torch.Tensor] = {}
    for manifest in manifests:
        for shard in json.loads(manifest.read_text())["shards"]:
            loaded = load_file(str(out / shard["file"]))
            tensors.update(loaded)
            stats.buckets += 1
            stats.tensors += len(loaded)
            stats.bytes += sum(t.numel() * t.element_size() for t in loaded.values())
    stats.seconds = time.perf_counter() - start
    return tensors, stats
