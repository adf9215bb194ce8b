"""Llama 3's RoPE frequency scaling, built here for any ``original_max_position_embeddings`` and
low/high frequency factors (Megatron's own ``rope_scaling=True`` fixes them at 8192, 1 and 4).

The formula is Meta's (and transformers' ``_compute_llama3_parameters``): wavelengths shorter than
``original / high_freq_factor`` keep their frequency, those longer than ``original /
low_freq_factor`` are slowed by ``factor``, and the ones between are interpolated smoothly."""

from __future__ import annotations

import math

import torch

from ..config.schema import ModelConfig


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float = 1.0,
                    high_freq_factor: float = 4.0, original_max_position_embeddings: int = 8192) -> torch.Tensor:
    """Plain RoPE inverse frequencies ``inv_freq`` scaled the Llama-3 way, in ``inv_freq``'s dtype."""
    old_context = original_max_position_embeddings
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def use_llama3_rope(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Give a freshly built GPTModel's rotary embedding (built plain) the Llama-3 scaled table."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        return
    rotary.inv_freq = llama3_inv_freq(rotary.inv_freq, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                                      cfg.rope_high_freq_factor, cfg.rope_original_max_position_embeddings)
