"""Read and write Hugging Face checkpoint directories (config.json + safetensors), one tensor at a
time, and move weights between such a directory and a full (TP=PP=EP=1) Megatron GPTModel.

Memory bound: reading memory-maps the safetensors files and materialises only the few HF tensors one
Megatron tensor is built from; writing buffers at most one output shard. So converting holds the
model plus O(one layer's tensor, one shard), never two full copies of the weights.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from ..config.schema import ModelConfig
from ..errors import UserError
from .hf_names import hf_sources, is_weight, megatron_to_hf, to_megatron

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
# Files a tokenizer may consist of; copied as they are next to the converted weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")
_ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Progress = Optional[Callable[[int], None]]


class ConversionError(UserError):
    """A checkpoint that cannot be converted as asked; the message names the tensor and the fix."""


class HFTensorReader:
    """Name -> tensor access to the safetensors files of an HF directory, one tensor at a time."""

    def __init__(self, path: Path | str):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map: Dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise ConversionError(f"{index}: not a safetensors index ({err}); restore the file or delete it "
                                      "so that the *.safetensors files are read directly") from None
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ConversionError(f"no weights: {self.path} has a config.json but no *.safetensors files; "
                                      "copy the model's safetensors files there (or point to the full download)")
            weight_map = {}
            for file in files:
                with self._opened(safe_open, file) as handle:
                    weight_map.update({k: file.name for k in handle.keys()})
        self.weight_map = weight_map
        self._open = safe_open

    def names(self) -> List[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ConversionError(f"tensor {name!r} is missing from {self.path}")
        # safe_open memory-maps the file and get_tensor copies out just that tensor. The handle is
        # closed right away: a handle kept open keeps every page read through it resident, which
        # by the end of a conversion is the whole checkpoint, a second copy of the model in RSS
        # (measured: 0.94 GB extra on a 0.94 GB model). Re-opening costs a header parse.
        with self._opened(self._open, self.path / self.weight_map[name]) as handle:
            try:
                return handle.get_tensor(name)
            except Exception as err:  # noqa: BLE001 - safetensors' own error type is not importable
                raise self._damaged(self.path / self.weight_map[name], err) from None

    @classmethod
    def _opened(cls, safe_open, file: Path):
        """safe_open, with a missing, truncated or corrupt file as one ConversionError line."""
        try:
            return safe_open(str(file), "pt")
        except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: the file is unusable either way
            raise cls._damaged(file, err) from None

    @staticmethod
    def _damaged(file: Path, err: BaseException) -> ConversionError:
        return ConversionError(f"cannot read {file} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}): "
                               "the file is truncated or damaged; copy or convert it again")


class HFShardWriter:
    """Writes (name, tensor) pairs into ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` each (a bigger single tensor gets a shard to itself) and the index."""

    def __init__(self, path: Path | str, max_shard_bytes: int = 5 * 2**30):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: Dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: List[Tuple[str, List[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
            self._flush()
        # clone: a view into a larger Megatron tensor would make safetensors store the whole base.
        self._buffer[name] = tensor.detach().to("cpu").contiguous().clone()
        self._buffer_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = f".shard-{len(self._shards):05d}.safetensors"
        save_file(self._buffer, str(self.path / tmp), metadata={"format": "pt"})
        self._shards.append((tmp, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> List[str]:
        """Flush, give the shards their final names, write the index; returns the shard names."""
        if self._buffer:
            self._flush()
        n = len(self._shards)
        weight_map: Dict[str, str] = {}
        names = []
        for i, (tmp, keys) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.path / tmp, self.path / final)
            weight_map.update({k: final for k in keys})
            names.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


def copy_tokenizer_files(src: Path | str, dst: Path | str) -> List[str]:
    """Copy the tokenizer files found in ``src`` to ``dst``; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _ACCEPTED_DTYPES:
        hint = ("quantized weights must be dequantized to bf16/fp32 first"
                if tensor.dtype in (torch.int8, torch.uint8, torch.int32) or "float8" in str(tensor.dtype)
                else "expected float32, bfloat16 or float16")
        raise ConversionError(f"tensor {name!r} has dtype {str(tensor.dtype).replace('torch.', '')}: {hint}")


def expected_hf_shapes(name: str, shape: torch.Size, cfg: ModelConfig) -> Dict[str, torch.Size]:
    """The HF tensor shapes a Megatron tensor of ``shape`` maps to (computed on the meta device)."""
    return {k: v.shape for k, v in megatron_to_hf(name, torch.empty(shape, device="meta"), cfg)}


def full_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The model's tensors by Megatron name (entries without weights dropped)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, reader: HFTensorReader, cfg: ModelConfig,
                    progress: Progress = None) -> List[str]:
    """Copy an HF checkpoint into a full (TP=PP=EP=1) Megatron model in place, one Megatron tensor
    at a time. Raises ConversionError naming the tensor for a missing tensor, a shape mismatch or
    an unusable dtype. Returns the HF tensors that were not used (e.g. rotary caches)."""
    used = set()
    for name, param in full_state(model).items():
        sources = hf_sources(name, cfg) if is_weight(name, cfg) else []
        if not sources:
            if progress:
                progress(1)
            continue
        expected = expected_hf_shapes(name, param.shape, cfg)
        parts = []
        for src in sources:
            if src not in reader:
                raise ConversionError(f"tensor {src!r} (needed for Megatron {name!r}) is missing from {reader.path}")
            tensor = reader.get(src)
            _check_dtype(src, tensor)
            if tensor.shape != expected[src]:
                raise ConversionError(f"tensor {src!r} has shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(expected[src])} from config.json")
            parts.append(tensor)
            used.add(src)
        param.copy_(to_megatron(name, parts, cfg).to(param.dtype))
        del parts
        if progress:
            progress(1)
    unused = sorted(set(reader.names()) - used)
    if unused:
        logger.warning("%d HF tensors not used: %s", len(unused), ", ".join(unused[:8]) + (" ..." if len(unused) > 8 else ""))
    return unused


def hf_tensors(state: Iterable[Tuple[str, torch.Tensor]], cfg: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs from full Megatron (name, tensor) pairs, one Megatron tensor at a time."""
    for name, tensor in state:
        if isinstance(tensor, torch.Tensor):
            yield from megatron_to_hf(name, tensor.detach(), cfg)


def write_hf_checkpoint(out: Path | str, tensors: Iterable[Tuple[str, torch.Tensor]], hf_config: Dict,
                        dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 * 2**30,
                        progress: Progress = None) -> List[str]:
    """Write config.json, safetensors shards and their index; ``dtype`` casts the weights."""
    out = Path(out)
    writer = HFShardWriter(out, max_shard_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor if dtype is None else tensor.to(dtype))
        if progress:
            progress(1)
    shards = writer.close()
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return shards
