"""Build the tokenizer and the prompt stream a config asks for."""

from __future__ import annotations

from typing import Iterable, Iterator, Tuple

from ..config.schema import RootConfig
from .datasets import CHAT, DatasetError, DatasetPrompts, DigitTask, PROMPT_KEYS, Prompt, TEMPLATES, row_location
from .fields import RowFields, answer_targets, prompt_content, required
from .files import dataset_format, read_rows
from .mixture import MixedPrompts
from .sources import SourceSpec, source_specs
from .tokenizer import Tokenizer, char_tokenizer, load_pretrained_tokenizer, train_bpe

DIGIT_TASKS = ("reverse_digits", "sort_digits")


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
    # Byte-level BPE trained on the datasets' own prompts and answers (offline, ~1 s).
    return train_bpe(_training_texts(cfg), d.bpe_vocab_size)


def _training_texts(cfg: RootConfig) -> Iterator[str]:
    """Each row's prompt (under its text template, or its messages' contents) and answer."""
    d = cfg.data
    for spec in source_specs(d):
        kind, rows = dataset_format(spec.path), read_rows(spec.path, spec.split)
        fields = _fields(spec).resolved(rows[0], PROMPT_KEYS.get(d.name, "question"), row_location(spec.path, kind, 1))
        for i, row in enumerate(rows):
            where = row_location(spec.path, kind, i + 1)
            content = prompt_content(required(row, fields.prompt_key, where), fields.prompt_key, where)
            text = (" ".join(m["content"] for m in content) if isinstance(content, list)
                    else TEMPLATES[d.template].format(question=content))
            yield text + " " + answer_targets(required(row, fields.answer_key, where), fields.answer_key, where)[0]


def _fields(spec: SourceSpec) -> RowFields:
    return RowFields(spec.prompt_key, spec.answer_key, spec.system_key, spec.system_prompt)


def build_prompts(cfg: RootConfig, tokenizer: Tokenizer) -> Iterable[Prompt]:
    d = cfg.data
    if d.name in DIGIT_TASKS:
        return DigitTask(d.name, tokenizer, d.digits, d.min_digits, d.max_digits, cfg.trainer.seed,
                         distinct=d.distinct_digits, length_tail=d.length_tail)
    specs = source_specs(d)
    # Source k shuffles with seed + k: a single source gives the stream it always gave.
    datasets = [DatasetPrompts(s.path, tokenizer, s.prompt_key, s.answer_key, d.template, d.max_prompt_tokens,
                               cfg.trainer.seed + k, d.shuffle, gsm8k=d.name == "gsm8k", system_key=s.system_key,
                               system_prompt=s.system_prompt, split=s.split,
                               default_prompt_key=PROMPT_KEYS.get(d.name, "question"), uid_prefix=s.uid_prefix)
                for k, s in enumerate(specs)]
    if len(datasets) == 1:
        return datasets[0]
    return MixedPrompts([(ds, s.weight) for ds, s in zip(datasets, specs)], cfg.trainer.seed)


def build_data(cfg: RootConfig) -> Tuple[Tokenizer, Iterable[Prompt]]:
    tokenizer = build_tokenizer(cfg)
    return tokenizer, build_prompts(cfg, tokenizer)
