"""Checkpoint conversion between Hugging Face directories and Megatron distributed checkpoints, and
loading either kind into a freshly built model (``model.path``).

A Megatron checkpoint here is a ``dist_checkpointing`` directory: it stores global tensors, so one
written from a single process loads at any TP/PP/EP layout (Megatron reshards on load). Next to
it, ``model_config.json`` records our ModelConfig, the vocabulary size and the HF config it came
from, so it can be converted back without other input. Training checkpoints
(``run_dir/checkpoints/step_N``) are read too: their config comes from ``run_dir/config.yaml``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from ..config.schema import ModelConfig
from .hf_checkpoint import (ConversionError, HFTensorReader, copy_tokenizer_files, full_state, hf_tensors,
                            load_hf_weights, write_hf_checkpoint)
from .hf_config import hf_config_from_model, model_config_from_hf, read_hf_config

logger = logging.getLogger(__name__)

MODEL_CONFIG = "model_config.json"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

Progress = Optional[Callable[[int], None]]


def is_hf_dir(path: Path | str) -> bool:
    return (Path(path) / "config.json").is_file()


def is_megatron_dir(path: Path | str) -> bool:
    return (Path(path) / "metadata.json").is_file()


def hf_dtype(hf: Dict[str, Any]) -> Optional[str]:
    """The checkpoint's own dtype (fp32/bf16/fp16) as its config.json states it, if it does."""
    return _HF_DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or ""))


def check_layout(cfg: ModelConfig, vocab_size: int, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Raise ConversionError if the model cannot be split at this TP/PP/EP layout."""
    from .layout import layout_problems

    problems = layout_problems(cfg, tp, pp, ep, prefix="--", vocab_size=vocab_size)
    if problems:
        raise ConversionError(f"cannot use layout tp={tp} pp={pp} ep={ep}: " + "; ".join(problems))


# ------------------------------------------------------------------ Megatron checkpoint metadata
def write_model_config(path: Path | str, cfg: ModelConfig, vocab_size: int, hf_config: Optional[Dict] = None) -> None:
    record = {"model": dataclasses.asdict(cfg), "vocab_size": vocab_size, "hf_config": hf_config}
    (Path(path) / MODEL_CONFIG).write_text(json.dumps(record, indent=1) + "\n")


def _vocab_from_metadata(path: Path) -> int:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    if "embedding.word_embeddings.weight" not in meta:
        raise ConversionError(f"{path} holds no tensor 'embedding.word_embeddings.weight': not a GPT model checkpoint")
    return int(meta["embedding.word_embeddings.weight"].global_shape[0])


def read_model_config(path: Path | str) -> Tuple[ModelConfig, int, Optional[Dict]]:
    """(ModelConfig, vocab size, original HF config or None) of a Megatron checkpoint directory."""
    path = Path(path)
    record_file = path / MODEL_CONFIG
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        return ModelConfig(**record["model"]), int(record["vocab_size"]), record.get("hf_config")
    run_config = path.parent.parent / "config.yaml"  # run_dir/checkpoints/step_N
    if run_config.is_file():
        from omegaconf import OmegaConf

        from ..config.schema import RootConfig

        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), OmegaConf.load(run_config))
        cfg = OmegaConf.to_object(merged).model
        # A run started from an HF model.path: its config.json keeps the keys we do not model.
        base = read_hf_config(cfg.path) if cfg.path and is_hf_dir(cfg.path) else None
        return cfg, _vocab_from_metadata(path), base
    raise ConversionError(f"{path} has neither {MODEL_CONFIG} nor a run's config.yaml two levels up: "
                          "cannot tell the model's shape")


# ------------------------------------------------------------------ loading into a built model
@torch.no_grad()
def load_megatron_weights(model: torch.nn.Module, path: Path | str) -> None:
    """Load the model weights of a dist checkpoint (converted or training) into a model built at
    any layout. Megatron reads most tensors straight into the parameters; only the fused gate/up
    projections are assembled in a temporary buffer (its SwiGLU sharding factory) and copied in,
    so loading holds the model plus those, not a second copy of the model."""
    from megatron.core import dist_checkpointing

    if not is_megatron_dir(path):
        raise ConversionError(f"{path} is not a Megatron dist checkpoint (no metadata.json)")
    _refuse_lora_adapters(path)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))["model"]
    model.load_state_dict(state)


def _refuse_lora_adapters(path: Path | str) -> None:
    """A LoRA run's training checkpoint holds the frozen base and the adapters apart: loading it
    as a plain model would drop the adapters (the trained part) without a word."""
    from megatron.core import dist_checkpointing

    from .lora import is_adapter_name

    adapters = [k for k in dist_checkpointing.load_tensors_metadata(str(path)) if is_adapter_name(k)]
    if adapters:
        raise ConversionError(f"{path} is a LoRA run's checkpoint ({len(adapters)} adapter tensors such as "
                              f"{adapters[0]!r}): a plain model would load its base without the adapters; merge them "
                              "with tools/merge_lora.py (or resume that run: same trainer.run_dir)")


def _build_full(cfg: ModelConfig, vocab_size: int) -> torch.nn.Module:
    from .gpt import build_gpt_model

    # No random init: the conversion overwrites every weight (a missing one is an error).
    return build_gpt_model(cfg, vocab_size, initialize=False).eval()


def _single_rank() -> bool:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size()) == (1, 1, 1)


def pretrained_model_config(path: Path | str, dtype: str) -> Tuple[ModelConfig, int]:
    """(ModelConfig, vocab size) of the checkpoint at ``path`` (HF or Megatron), in ``dtype``."""
    if is_hf_dir(path):
        return model_config_from_hf(read_hf_config(path), dtype=dtype)
    if is_megatron_dir(path):
        cfg, vocab, _ = read_model_config(path)
        return dataclasses.replace(cfg, dtype=dtype), vocab
    # Callers name the key (model.path): the message says what the directory lacks.
    raise ConversionError(f"{path} is neither a Hugging Face directory (config.json) "
                          "nor a Megatron dist checkpoint (metadata.json)")


def load_pretrained(model: torch.nn.Module, cfg: ModelConfig, path: Path | str) -> None:
    """Fill a built model (at any layout) with the weights at ``path``: an HF directory or a
    Megatron dist checkpoint."""
    if is_hf_dir(path):
        if _single_rank():
            load_hf_weights(model, HFTensorReader(path), cfg)
        else:
            from .hf_sharded import load_hf_weights_sharded

            load_hf_weights_sharded(model, HFTensorReader(path), cfg)
    else:
        load_megatron_weights(model, path)
    logger.info("loaded pretrained weights from %s", path)


# ------------------------------------------------------------------ whole-checkpoint conversions
def hf_to_megatron_checkpoint(src: Path | str, out: Path | str, dtype: Optional[str] = None,
                              layout: Tuple[int, int, int] = (1, 1, 1), progress: Progress = None,
                              total: Optional[Callable[[int], None]] = None) -> Path:
    """HF directory -> Megatron dist checkpoint (+ model_config.json, tokenizer files).

    In one process (Megatron parallel state at tp=pp=ep=1) the whole model is built and
    ``layout`` is only checked. Under torchrun, with the parallel state initialised at
    ``layout``, each rank builds and fills only its shard from the HF files, so no process
    holds the whole model (the way to convert models larger than one machine's memory).
    Either way the checkpoint loads at any layout the model divides into."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    hf = read_hf_config(src)
    dtype = dtype or hf_dtype(hf) or "fp32"
    if dtype == "fp16":
        raise ConversionError("fp16 Megatron models are not built here; use --dtype bf16 or fp32")
    cfg, vocab = model_config_from_hf(hf, dtype=dtype)
    check_layout(cfg, vocab, *layout)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ConversionError(f"output directory {out} is not empty")
    reader = HFTensorReader(src)
    if _single_rank():
        model = _build_full(cfg, vocab)
        if total:
            total(len(full_state(model)))
        load_hf_weights(model, reader, cfg, progress)
    else:
        from megatron.core import parallel_state

        from .gpt import build_gpt_model
        from .hf_sharded import load_hf_weights_sharded

        tp, pp, ep = layout
        # Only the first pipeline stage embeds, only the last has the output layer.
        model = build_gpt_model(cfg, vocab, tp=tp, pp=pp, ep=ep, initialize=False,
                                pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage()).eval()
        load_hf_weights_sharded(model, reader, cfg)
    if dist.is_initialized():
        dist.barrier()  # every rank has checked the output directory before anything is written
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(out))
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_model_config(out, cfg, vocab, hf)
        copy_tokenizer_files(src, out)
    if dist.is_initialized():
        dist.barrier()
    return out


def megatron_to_hf_checkpoint(src: Path | str, out: Path | str, dtype: Optional[str] = None,
                              max_shard_bytes: int = 5 * 2**30, tokenizer_dir: Optional[Path | str] = None,
                              progress: Progress = None, total: Optional[Callable[[int], None]] = None) -> Path:
    """Megatron dist checkpoint -> HF directory: config.json, safetensors shards + index, tokenizer
    files (from ``tokenizer_dir``, else those saved beside the checkpoint)."""
    cfg, vocab, base_hf = read_model_config(src)
    model = _build_full(cfg, vocab)
    state = full_state(model)
    n_hf = sum(len(list(hf_tensors([(k, torch.empty(v.shape, device="meta"))], cfg))) for k, v in state.items())
    if total:
        total(n_hf)
    load_megatron_weights(model, src)
    hf_config = hf_config_from_model(cfg, vocab, base_hf)
    dtype = dtype or (base_hf and hf_dtype(base_hf)) or cfg.dtype
    hf_config["dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"output directory {out} is not empty")
    write_hf_checkpoint(out, hf_tensors(state.items(), cfg), hf_config, dtype=_DTYPES[dtype],
                        max_shard_bytes=max_shard_bytes, progress=progress)
    _write_tokenizer(tokenizer_source(src, tokenizer_dir), out)
    return out


def run_dir_of(checkpoint: Path | str) -> Optional[Path]:
    """The run directory of a run's ``<run_dir>/checkpoints/step_N``, else None."""
    checkpoint = Path(checkpoint).resolve()
    if checkpoint.parent.name == "checkpoints" and (checkpoint.parent.parent / "config.yaml").is_file():
        return checkpoint.parent.parent
    return None


def tokenizer_source(checkpoint: Path | str, tokenizer_dir: Optional[Path | str] = None) -> Optional[Path]:
    """Where a checkpoint's tokenizer files are: ``tokenizer_dir`` when given, else those saved
    beside the checkpoint (a converted one), else its run directory's (the tokenizer the run
    trained with), else None."""
    if tokenizer_dir is not None:
        return Path(tokenizer_dir)
    if (Path(checkpoint) / "tokenizer.json").is_file():
        return Path(checkpoint)
    run_dir = run_dir_of(checkpoint)
    if run_dir is not None and (run_dir / "tokenizer.json").is_file():
        return run_dir
    return None


def _write_tokenizer(source: Optional[Path | str], out: Path) -> None:
    """Copy the tokenizer files, then fill in the EOS/PAD keys transformers needs where they lack."""
    from ..data.tokenizer import complete_hf_tokenizer_dir

    if source is not None:
        copy_tokenizer_files(source, out)
    complete_hf_tokenizer_dir(out)


def megatron_to_megatron_checkpoint(src: Path | str, out: Path | str, dtype: Optional[str] = None) -> Path:
    """Re-save a Megatron checkpoint (model weights only), optionally in another dtype; a training
    checkpoint becomes a self-describing one (model_config.json)."""
    from megatron.core import dist_checkpointing

    cfg, vocab, base_hf = read_model_config(src)
    source = _build_full(cfg, vocab)
    load_megatron_weights(source, src)
    if dtype and dtype != cfg.dtype:
        cfg = dataclasses.replace(cfg, dtype=dtype)
        source = source.to(_DTYPES[dtype])
        source.config.params_dtype = _DTYPES[dtype]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ConversionError(f"output directory {out} is not empty")
    dist_checkpointing.save({"model": source.sharded_state_dict()}, str(out))
    write_model_config(out, cfg, vocab, base_hf)
    copy_tokenizer_files(src, out)
    return out



def export_hf_checkpoint(tensors: Iterable[Tuple[str, torch.Tensor]], cfg: ModelConfig, vocab_size: int,
                         out: Path | str, tokenizer_dir: Optional[Path | str] = None) -> Path:
    """Write HF-named full tensors (e.g. ``Learner.export_hf_weights()``) as an HF directory. A
    model started from an HF ``model.path`` keeps that config's other keys (token ids, ...). The
    tokenizer files come from ``tokenizer_dir`` (the run's: the one the model was trained with),
    else from the HF ``model.path``."""
    base = read_hf_config(cfg.path) if cfg.path and is_hf_dir(cfg.path) else None
    out = Path(out)
    write_hf_checkpoint(out, tensors, hf_config_from_model(cfg, vocab_size, base))
    _write_tokenizer(tokenizer_dir or (cfg.path if base is not None else None), out)
    return out
