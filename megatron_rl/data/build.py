"""Build the tokenizer and the prompt stream a config asks for."""

from __future__ import annotations

from typing import Iterable, Tuple

from ..config.schema import RootConfig
from .datasets import CHAT, DatasetError, DigitTask, JsonlPrompts, Prompt, TEMPLATES, prompt_key, read_jsonl
from .tokenizer import Tokenizer, char_tokenizer, load_pretrained_tokenizer, train_bpe


def build_tokenizer(cfg: RootConfig) -> Tokenizer:
    d = cfg.data
    if d.tokenizer == "model":
        directory = d.tokenizer_path or cfg.model.path
        if directory is None:
            raise DatasetError("data.tokenizer=model reads model.path's tokenizer.json, and model.path is not set; "
                               "set model.path (or data.tokenizer_path) to a Hugging Face directory, or choose "
                               "data.tokenizer=char|bpe")
        try:
            return load_pretrained_tokenizer(directory)
        except ValueError as err:
            raise DatasetError(str(err)) from None
    if d.template == CHAT:
        raise DatasetError(f"data.template=chat needs the checkpoint's chat template, but data.tokenizer={d.tokenizer}; "
                           "set data.tokenizer=model (with model.path) or data.template=plain|qa")
    if d.tokenizer == "char":
        return char_tokenizer(d.digits + "=")
    # Byte-level BPE trained on the dataset's own prompts and answers (offline, ~1 s).
    key = prompt_key(d.name, d.prompt_key)
    rows = read_jsonl(d.path, [key, d.answer_key])
    texts = (TEMPLATES[d.template].format(question=r[key]) + " " + r[d.answer_key] for r in rows)
    return train_bpe(texts, d.bpe_vocab_size)


def build_prompts(cfg: RootConfig, tokenizer: Tokenizer) -> Iterable[Prompt]:
    d = cfg.data
    if d.name in ("reverse_digits", "sort_digits"):
        return DigitTask(d.name, tokenizer, d.digits, d.min_digits, d.max_digits, cfg.trainer.seed,
                         distinct=d.distinct_digits, length_tail=d.length_tail)
    return JsonlPrompts(d.path, tokenizer, prompt_key(d.name, d.prompt_key), d.answer_key, d.template, d.max_prompt_tokens,
                        cfg.trainer.seed, d.shuffle, gsm8k=d.name == "gsm8k")


def build_data(cfg: RootConfig) -> Tuple[Tokenizer, Iterable[Prompt]]:
    tokenizer = build_tokenizer(cfg)
    return tokenizer, build_prompts(cfg, tokenizer)
