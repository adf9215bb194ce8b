"""``model.path``: start training from a Hugging Face directory or a Megatron dist checkpoint.

The checkpoint decides the architecture: family and sizes are read from its config.json (or the
Megatron checkpoint's model_config.json), replacing whatever the recipe said; only ``model.dtype``
(and the path) stay the user's. The vocabulary is the checkpoint's, so the embedding shapes match.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config.schema import ModelConfig
from ..errors import ConfigError
from .convert import load_pretrained, pretrained_model_config
from .gpt import padded_vocab_size
from .hf_checkpoint import ConversionError
from .hf_config import UnsupportedConfigError

__all__ = ["check_vocabulary", "load_pretrained", "resolve_model_config", "vocab_size_for"]


def resolve_model_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the checkpoint's architecture when ``cfg.path`` is set; ``cfg`` otherwise.
    Raises ValueError with a one-line message naming model.path."""
    if cfg.path is None:
        return cfg
    if not Path(cfg.path).is_dir():
        raise ValueError(f"model.path={cfg.path!r} is not a directory")
    try:
        loaded, _ = pretrained_model_config(cfg.path, cfg.dtype)
    except (ConversionError, UnsupportedConfigError) as err:
        raise ValueError(f"model.path={cfg.path!r}: {err}") from None
    return dataclasses.replace(loaded, path=cfg.path, dtype=cfg.dtype)


def vocab_size_for(cfg: ModelConfig, tokenizer_vocab: int, tp: int = 1) -> int:
    """The model's vocabulary: the checkpoint's with ``model.path`` (it must cover the tokenizer's
    ids), otherwise the tokenizer's padded for TP."""
    if cfg.path is None:
        return padded_vocab_size(tokenizer_vocab, tp)
    _, vocab = pretrained_model_config(cfg.path, cfg.dtype)
    if tokenizer_vocab > vocab:
        has = (Path(cfg.path) / "tokenizer.json").is_file()
        raise ConversionError(f"the tokenizer has {tokenizer_vocab} ids but model.path={cfg.path!r} has a vocabulary "
                              f"of {vocab}: set data.tokenizer=model to use the checkpoint's own tokenizer "
                              "(tokenizer.json)" + ("" if has else "; copy it into model.path first: it has none"))
    return vocab


# A vocabulary this large was trained on text; a tokenizer of under half of it does not match it.
PRETRAINED_VOCAB = 32000


def check_vocabulary(cfg, tokenizer_vocab: int) -> None:
    """Refuse a tokenizer far smaller than a pretrained checkpoint's vocabulary (a 16k BPE fitted
    on the dataset fed to a 152k embedding): its ids would pick rows trained for other tokens.
    The composition root asks once the tokenizer is built (data/ knows no checkpoint)."""
    if cfg.model.path is None or cfg.data.force_tokenizer:
        return
    try:
        _, vocab = pretrained_model_config(cfg.model.path, cfg.model.dtype)
    except Exception:  # an unreadable checkpoint is reported where the model is built
        return
    if vocab >= PRETRAINED_VOCAB and tokenizer_vocab * 2 < vocab:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} ids but model.path={cfg.model.path!r} has a "
                          f"pretrained vocabulary of {vocab}: its ids would select embedding rows trained for other "
                          "tokens; use the checkpoint's tokenizer (data.tokenizer_path=<its Hugging Face "
                          "directory>), or set data.force_tokenizer=true")
