"""A LoRA run's checkpoint (``run_dir/checkpoints/step_N``: the frozen base and the adapters) out
to Hugging Face: the adapters as a PEFT directory, the base as an HF directory, or the two merged
into one HF checkpoint (in fp32). Also the merge of an HF base directory with a PEFT directory.

The checkpoint is read in one process (TP=PP=1): Megatron reshards any training layout on load.
The run's ``config.yaml`` (two levels up) gives the model and the LoRA keys.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch

from ..config.schema import LoraConfig, ModelConfig
from .convert import _DTYPES, _build_full, _write_tokenizer, read_model_config, tokenizer_source
from .hf_checkpoint import ConversionError, HFTensorReader, hf_tensors, write_hf_checkpoint
from .hf_config import hf_config_from_model, read_hf_config
from .lora import add_lora, export_state, is_adapter_name
from .peft_adapters import (adapter_config, lora_scaling, merged_hf_tensors, peft_tensors, read_peft_dir,
                            write_peft_dir)

logger = logging.getLogger(__name__)


def read_run_lora(checkpoint: Path | str) -> LoraConfig:
    """The LoRA keys of the run that wrote ``checkpoint`` (its ``config.yaml`` two levels up)."""
    from omegaconf import OmegaConf

    from ..config.schema import RootConfig

    run_config = Path(checkpoint).parent.parent / "config.yaml"
    if not run_config.is_file():
        raise ConversionError(f"{checkpoint} is not a run's checkpoint (no {run_config}): LoRA adapters are read "
                              "from a training run's run_dir/checkpoints/step_N")
    lora = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RootConfig), OmegaConf.load(run_config))).lora
    if lora.rank <= 0:
        raise ConversionError(f"{checkpoint} is from a run without LoRA (lora.rank={lora.rank}): convert it with "
                              "tools/convert_checkpoint.py megatron-to-hf")
    return lora


class LoraCheckpoint:
    """A LoRA run's checkpoint loaded into one full model (base and adapters)."""

    def __init__(self, checkpoint: Path | str):
        from megatron.core import dist_checkpointing

        self.path = Path(checkpoint)
        self.lora = read_run_lora(self.path)
        self.cfg, self.vocab, self.base_hf = read_model_config(self.path)
        self.model = _build_full(self.cfg, self.vocab)
        add_lora(self.model, self.lora.rank, self.lora.alpha, 0.0, self.lora.targets)
        state = dist_checkpointing.load({"model": self.model.sharded_state_dict()}, str(self.path))["model"]
        self.model.load_state_dict(state)

    def adapters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The full Megatron adapter tensors (``...linear_qkv.lora_a``)."""
        for name, tensor in export_state(self.model, merge=False):
            if is_adapter_name(name):
                yield name, tensor.detach()

    def base_hf_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The frozen base's tensors under HF names (the adapters left out)."""
        base = ((n, t) for n, t in export_state(self.model, merge=False) if not is_adapter_name(n))
        return hf_tensors(base, self.cfg)

    def hf_config(self, dtype: str) -> Dict:
        config = hf_config_from_model(self.cfg, self.vocab, self.base_hf)
        config["dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
        return config

    def base_model_dir(self) -> Optional[str]:
        """The run's HF ``model.path`` (the base PEFT loads onto), None if it had none."""
        path = self.cfg.path
        return str(Path(path).resolve()) if path and (Path(path) / "config.json").is_file() else None


def _empty_dir(out: Path) -> Path:
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"output directory {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_peft_from_learner(out: Path | str, adapters: Dict[str, torch.Tensor], cfg: ModelConfig,
                            lora: LoraConfig, base_model: Optional[str]) -> Path:
    """A PEFT directory from full Megatron adapter tensors (a learner's ``adapter_tensors``)."""
    config = adapter_config(lora.rank, lora.alpha, lora.dropout, lora.targets, base_model)
    return write_peft_dir(out, peft_tensors(adapters.items(), cfg), config)


def export_peft(checkpoint: Path | str, out: Path | str, base_out: Optional[Path | str] = None,
                tokenizer_dir: Optional[Path | str] = None) -> Path:
    """A LoRA run's checkpoint -> a PEFT directory at ``out``; with ``base_out`` also the frozen
    base as an HF directory there (the base the adapter config then names). Without it the
    adapter names the run's HF ``model.path``."""
    ckpt = LoraCheckpoint(checkpoint)
    base_model = ckpt.base_model_dir()
    if base_out is not None:
        base_out = _empty_dir(Path(base_out))
        write_hf_checkpoint(base_out, ckpt.base_hf_tensors(), ckpt.hf_config(ckpt.cfg.dtype))
        _write_tokenizer(tokenizer_source(checkpoint, tokenizer_dir), base_out)
        base_model = str(base_out.resolve())
    out = _empty_dir(Path(out))
    if base_model is None:
        logger.warning("the run had no HF model.path and no --base-out was given: %s names no base model", out)
    return write_peft_from_learner(out, dict(ckpt.adapters()), ckpt.cfg, ckpt.lora, base_model)


def merge_checkpoint(checkpoint: Path | str, out: Path | str, dtype: Optional[str] = None,
                     max_shard_bytes: int = 5 * 2**30, tokenizer_dir: Optional[Path | str] = None) -> Path:
    """A LoRA run's checkpoint -> one HF checkpoint with each adapted weight ``W + (alpha/rank)·B·A``
    computed in fp32 and written in ``dtype`` (default: the model's)."""
    ckpt = LoraCheckpoint(checkpoint)
    dtype = dtype or ckpt.cfg.dtype
    adapters = peft_tensors(ckpt.adapters(), ckpt.cfg)
    out = _empty_dir(Path(out))
    merged = merged_hf_tensors(ckpt.base_hf_tensors(), adapters, ckpt.lora.alpha / ckpt.lora.rank, _DTYPES[dtype])
    write_hf_checkpoint(out, merged, ckpt.hf_config(dtype), max_shard_bytes=max_shard_bytes)
    _write_tokenizer(tokenizer_source(checkpoint, tokenizer_dir), out)
    return out


def merge_peft(base_dir: Path | str, adapter_dir: Path | str, out: Path | str, dtype: Optional[str] = None,
               max_shard_bytes: int = 5 * 2**30, tokenizer_dir: Optional[Path | str] = None) -> Path:
    """An HF base directory + a PEFT LoRA directory -> one HF checkpoint, merged in fp32 and
    written in ``dtype`` (default: each base tensor's own), with the tokenizer files of
    ``tokenizer_dir`` (default: the base's). Any HF model works, not only ours."""
    from .hf_checkpoint import copy_tokenizer_files

    config, adapters = read_peft_dir(adapter_dir)
    scaling = lora_scaling(config)
    reader = HFTensorReader(base_dir)
    hf_config = read_hf_config(base_dir)
    if dtype:
        hf_config["dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
        hf_config.pop("torch_dtype", None)
    out = _empty_dir(Path(out))
    base = ((name, reader.get(name)) for name in reader.names())
    write_hf_checkpoint(out, merged_hf_tensors(base, adapters, scaling, _DTYPES[dtype] if dtype else None), hf_config,
                        max_shard_bytes=max_shard_bytes)
    copy_tokenizer_files(tokenizer_dir or base_dir, out)
    return out
