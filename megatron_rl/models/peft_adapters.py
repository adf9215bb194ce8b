"""LoRA adapters in Hugging Face PEFT's layout: a directory with ``adapter_config.json`` and
``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained`` loads onto the HF base
model, and the merge of such adapters into HF weights (no Megatron here, only names and tensors).

Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``; PEFT adapts each HF
projection apart. A fused column-parallel adapter computes ``B·(A·x)`` with one A shared by the
fused outputs, so each HF projection gets that same A and its own rows of B (split as the fused
weight splits, ``hf_names.megatron_to_hf``): ``q = B_q·A·x`` is exactly the fused path's q rows.
PEFT scales by ``lora_alpha / r`` as the learner scales by ``alpha / rank``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..config.schema import ModelConfig
from .hf_checkpoint import ConversionError
from .hf_names import hf_sources, megatron_to_hf

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's saved names: the wrapped model's module path under ``base_model.model.``, then
# ``lora_A.weight`` / ``lora_B.weight`` (the adapter's name, "default", is left out on save).
PEFT_PREFIX = "base_model.model."
# Megatron projection -> the HF projections it fuses (the leaf names PEFT's target_modules match).
HF_PROJECTIONS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def target_modules(targets: Sequence[str]) -> List[str]:
    """PEFT's ``target_modules`` for the learner's ``lora.targets``."""
    return [hf for t in targets for hf in HF_PROJECTIONS[t]]


def to_peft(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """PEFT (name, tensor) pairs for one full Megatron adapter tensor, e.g.
    ``decoder.layers.0.self_attention.linear_qkv.lora_a`` -> the q/k/v projections' lora_A (the
    same A for each); ``...lora_b`` -> their lora_B (B's rows split as the fused weight's)."""
    linear, which = name.rsplit(".", 1)
    if which not in ("lora_a", "lora_b"):
        raise ValueError(f"{name!r} is not a LoRA adapter tensor (…lora_a or …lora_b)")
    weight = f"{linear}.weight"
    modules = [source.removesuffix(".weight") for source in hf_sources(weight, cfg)]
    if which == "lora_a":
        parts = [tensor.clone() for _ in modules]  # safetensors refuses tensors that share memory
    else:
        parts = [part for _, part in megatron_to_hf(weight, tensor, cfg)]
    kind = "lora_A" if which == "lora_a" else "lora_B"
    for module, part in zip(modules, parts):
        yield f"{PEFT_PREFIX}{module}.{kind}.weight", part.contiguous()


def peft_tensors(adapters: Iterable[Tuple[str, torch.Tensor]], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Every full Megatron adapter tensor under PEFT's names."""
    return {k: v for name, tensor in adapters for k, v in to_peft(name, tensor, cfg)}


def adapter_config(rank: int, alpha: float, dropout: float, targets: Sequence[str],
                   base_model: Optional[str]) -> Dict[str, Any]:
    """PEFT's adapter_config.json for the learner's LoRA keys; ``base_model``: the HF base
    directory PEFT records (``base_model_name_or_path``), None when there is none."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": target_modules(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_dir(out: Path | str, tensors: Dict[str, torch.Tensor], config: Dict[str, Any]) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (the tensors in fp32)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return out


def read_peft_dir(path: Path | str) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(adapter config, tensors under PEFT's names) of a PEFT LoRA directory."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ConversionError(f"{path} is not a PEFT adapter directory: it needs {ADAPTER_CONFIG} and "
                              f"{ADAPTER_WEIGHTS} (as peft's save_pretrained writes them)")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    return config, load_file(str(path / ADAPTER_WEIGHTS))


def lora_scaling(config: Dict[str, Any]) -> float:
    """The factor PEFT multiplies B·A by; the options that change the update's form are refused."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ConversionError(f"adapter is peft_type={config.get('peft_type')!r}: only LORA adapters merge here")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise ConversionError(f"adapter_config.json has {key}=true: not supported by this merge "
                                  "(merge it with peft's merge_and_unload)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ConversionError(f"adapter_config.json has a {key}: per-module ranks are not supported by this merge "
                                  "(merge it with peft's merge_and_unload)")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def merged_hf_tensors(base: Iterable[Tuple[str, torch.Tensor]], adapters: Dict[str, torch.Tensor],
                      scaling: float, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """The base model's HF tensors with each adapted weight replaced by ``W + scaling·B·A``,
    computed in fp32 and cast to ``dtype`` (default: the base weight's). Raises ConversionError,
    after the last tensor, if an adapter matched no weight of the base (another model's adapter)."""
    unused = {k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in adapters}
    for name, tensor in base:
        module = name.removesuffix(".weight")
        a = adapters.get(f"{PEFT_PREFIX}{module}.lora_A.weight")
        if name.endswith(".weight") and a is not None:
            b = adapters[f"{PEFT_PREFIX}{module}.lora_B.weight"]
            merged = tensor.float() + scaling * (b.float() @ a.float())
            unused.discard(module)
            yield name, merged.to(dtype or tensor.dtype)
        else:
            yield name, tensor if dtype is None else tensor.to(dtype)
    if unused:
        raise ConversionError(f"{len(unused)} adapted modules are not in the base model, e.g. {sorted(unused)[0]!r}: "
                              "the adapter was trained on another model")
