"""A Hugging Face model directory for our ModelConfig, so vLLM builds exactly our architecture.

``config.json`` is the one the checkpoint converter writes (``models/hf_config.py``), for every
family we convert (llama, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral, deepseek_v3); the weights,
when given, go to ``model.safetensors`` under HF names (``models/hf_names.py`` maps Megatron's).
No vLLM import here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from ...config.schema import ModelConfig
from ...models.hf_config import hf_config_from_model


def hf_config(cfg: ModelConfig, vocab_size: int) -> Dict[str, Any]:
    """The HF config.json dict of ``cfg`` with ``vocab_size`` (the learner's padded vocabulary)."""
    out = hf_config_from_model(cfg, vocab_size)
    # Token ids only: stops come with each request, never from the config.
    out.update(bos_token_id=None, eos_token_id=None)
    return out


def write_model_dir(path: Path, cfg: ModelConfig, vocab_size: int,
                    named_tensors: Optional[Iterable[Tuple[str, torch.Tensor]]] = None) -> Path:
    """Write config.json (and model.safetensors when ``named_tensors`` is given) under ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(cfg, vocab_size), indent=2))
    (path / "generation_config.json").write_text(json.dumps({"_from_model_config": True}))
    if named_tensors is not None:
        tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in named_tensors}
        save_file(tensors, str(path / "model.safetensors"))
    return path
