"""Build the tokenizer and the prompt stream a config asks for.

``data.tokenizer=auto`` (the default) takes the checkpoint's own tokenizer whenever there is one
(``data.tokenizer_path``, or ``model.path`` holding tokenizer files), else ``char`` for the
synthetic digit tasks and ``bpe`` for JSONL datasets. Another tokenizer for a checkpoint that has
its own, or a small one for a large pretrained vocabulary, is refused unless
``data.force_tokenizer=true``: the embedding's rows mean the checkpoint's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional, Tuple

from ..config.schema import RootConfig
from .arithmetic import ALPHABET as ARITHMETIC_ALPHABET, ArithmeticTask
from .datasets import CHAT, DatasetError, DatasetPrompts, DigitTask, PROMPT_KEYS, Prompt, TEMPLATES, row_location
from .fields import RowFields, answer_targets, prompt_and_answer
from .files import dataset_format, read_rows
from .mixture import MixedPrompts
from .sources import SourceSpec, source_specs
from .tokenizer import Tokenizer, char_tokenizer, load_pretrained_tokenizer, train_bpe

DIGIT_TASKS = ("reverse_digits", "sort_digits")
# Tasks that generate their prompts (no data.path; the char tokenizer by default).
SYNTHETIC_TASKS = (*DIGIT_TASKS, "arithmetic")
# Files whose presence says a directory ships a tokenizer.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
# A vocabulary this large is a pretrained one (the smallest in common use is Llama-2's 32,000); a
# tokenizer with fewer than half its ids cannot be the one its embedding was trained with.


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_MARKERS)


def checkpoint_tokenizer_dir(model_path: Optional[str]) -> Optional[Path]:
    """Where ``model.path``'s own tokenizer is: the directory itself (a Hugging Face checkpoint or a
    converted one), else the run directory of a run's ``checkpoints/step_N`` (the tokenizer the
    run trained with); None when it has none."""
    if not model_path:
        return None
    path = Path(model_path)
    if _has_tokenizer(path):
        return path
    resolved = path.resolve()
    run_dir = resolved.parent.parent
    if resolved.parent.name == "checkpoints" and (run_dir / "config.yaml").is_file() and _has_tokenizer(run_dir):
        return run_dir
    return None


def _vocabulary(directory: Path) -> Optional[dict]:
    try:
        from tokenizers import Tokenizer as HFTokenizer

        return HFTokenizer.from_file(str(directory / "tokenizer.json")).get_vocab(with_added_tokens=True)
    except Exception:  # unreadable or absent: loading it reports the problem
        return None


def choose_tokenizer(cfg: RootConfig) -> str:
    """The tokenizer ``data.tokenizer`` means for this config: auto resolved, and a choice that
    would feed a checkpoint ids of another vocabulary refused (DatasetError, one line) unless
    ``data.force_tokenizer=true``."""
    d = cfg.data
    own = checkpoint_tokenizer_dir(cfg.model.path)
    if d.tokenizer == "auto":
        if d.tokenizer_path or own is not None:
            choice = "model"
        else:
            choice = "char" if d.name in SYNTHETIC_TASKS else "bpe"
    else:
        choice = d.tokenizer
    if own is None or d.force_tokenizer:
        return choice
    if choice in ("char", "bpe"):
        raise DatasetError(f"data.tokenizer={choice} with model.path={cfg.model.path!r}, which has its own tokenizer "
                           f"({own}): the checkpoint's embedding rows mean its own tokens; leave data.tokenizer unset "
                           "(auto uses the checkpoint's), or set data.force_tokenizer=true to train through another")
    if d.tokenizer_path and Path(d.tokenizer_path).resolve() != own.resolve():
        theirs, ours = _vocabulary(Path(d.tokenizer_path)), _vocabulary(own)
        if theirs is not None and ours is not None and theirs != ours:
            raise DatasetError(f"data.tokenizer_path={d.tokenizer_path!r} has another vocabulary than the tokenizer of "
                               f"model.path ({own}): leave data.tokenizer_path unset to use the checkpoint's, or set "
                               "data.force_tokenizer=true")
    return choice


def build_tokenizer(cfg: RootConfig) -> Tokenizer:
    d = cfg.data
    choice = choose_tokenizer(cfg)
    if choice == "model":
        directory = d.tokenizer_path or checkpoint_tokenizer_dir(cfg.model.path) or cfg.model.path
        if directory is None:
            raise DatasetError("data.tokenizer=model reads model.path's tokenizer.json, and model.path is not set; "
                               "set model.path (or data.tokenizer_path) to a Hugging Face directory, or choose "
                               "data.tokenizer=char|bpe")
        try:
            tokenizer = load_pretrained_tokenizer(str(directory))
        except ValueError as err:
            raise DatasetError(str(err)) from None
    elif d.template == CHAT or d.apply_chat_template:
        key = "data.template=chat" if d.template == CHAT else "data.apply_chat_template=true"
        raise DatasetError(f"{key} needs the checkpoint's chat template, but data.tokenizer={choice}; "
                           "set model.path (or data.tokenizer_path) to a directory with a tokenizer, or "
                           + ("data.template=plain|qa" if d.template == CHAT else "data.apply_chat_template=null"))
    elif choice == "char":
        tokenizer = char_tokenizer(ARITHMETIC_ALPHABET if d.name == "arithmetic" else d.digits + "=")
    else:
        # Byte-level BPE trained on the datasets' own prompts and answers (offline, ~1 s).
        tokenizer = train_bpe(_training_texts(cfg), d.bpe_vocab_size)
    return tokenizer


def wraps_in_chat(cfg: RootConfig, tokenizer: Tokenizer) -> bool:
    """Whether JSONL prompts go through the tokenizer's chat template (``data.apply_chat_template``;
    null: when the tokenizer has one). ``data.template=chat`` renders its own way."""
    wanted = cfg.data.apply_chat_template
    if cfg.data.template == CHAT or wanted is False:
        return False
    if wanted and tokenizer.chat_template is None:
        raise DatasetError("data.apply_chat_template=true needs a chat template, and this tokenizer has none: use a "
                           "model.path (or data.tokenizer_path) whose tokenizer_config.json has a chat_template, or "
                           "leave data.apply_chat_template unset")
    return tokenizer.chat_template is not None


def _training_texts(cfg: RootConfig) -> Iterator[str]:
    """Each row's prompt (under its text template, or its messages' contents) and answer."""
    d = cfg.data
    for spec in source_specs(d):
        kind, rows = dataset_format(spec.path), read_rows(spec.path, spec.split)
        fields = _fields(spec).resolved(rows[0], PROMPT_KEYS.get(d.name, "question"), row_location(spec.path, kind, 1))
        for i, row in enumerate(rows):
            where = row_location(spec.path, kind, i + 1)
            content, answer = prompt_and_answer(row, fields, where)
            text = (" ".join(m["content"] for m in content) if isinstance(content, list)
                    else TEMPLATES[d.template].format(question=content))
            yield text + " " + answer_targets(answer, fields.answer_key, where)[0]


def _fields(spec: SourceSpec) -> RowFields:
    return RowFields(spec.prompt_key, spec.answer_key, spec.system_key, spec.system_prompt)


def build_prompts(cfg: RootConfig, tokenizer: Tokenizer) -> Iterable[Prompt]:
    d = cfg.data
    if d.name in DIGIT_TASKS:
        return DigitTask(d.name, tokenizer, d.digits, d.min_digits, d.max_digits, cfg.trainer.seed,
                         distinct=d.distinct_digits, length_tail=d.length_tail)
    if d.name == "arithmetic":
        return arithmetic_task(cfg, tokenizer, cfg.trainer.seed, "train")
    specs = source_specs(d)
    chat = wraps_in_chat(cfg, tokenizer)
    # Source k shuffles with seed + k: a single source gives the stream it always gave.
    datasets = [DatasetPrompts(s.path, tokenizer, s.prompt_key, s.answer_key, d.template, d.max_prompt_tokens,
                               cfg.trainer.seed + k, d.shuffle, gsm8k=d.name == "gsm8k", system_key=s.system_key,
                               system_prompt=s.system_prompt, split=s.split,
                               default_prompt_key=PROMPT_KEYS.get(d.name, "question"), uid_prefix=s.uid_prefix,
                               chat=chat)
                for k, s in enumerate(specs)]
    if len(datasets) == 1:
        return datasets[0]
    return MixedPrompts([(ds, s.weight) for ds, s in zip(datasets, specs)], cfg.trainer.seed)


def arithmetic_task(cfg: RootConfig, tokenizer: Tokenizer, seed: int, split: str) -> ArithmeticTask:
    """data.name=arithmetic's prompts of ``split`` (train for training, eval for the held-out set)."""
    d = cfg.data
    return ArithmeticTask(tokenizer, d.arithmetic_min_ops, d.arithmetic_max_ops, d.arithmetic_max_operand,
                          d.arithmetic_operators, seed, split)


def build_data(cfg: RootConfig) -> Tuple[Tokenizer, Iterable[Prompt]]:
    tokenizer = build_tokenizer(cfg)
    return tokenizer, build_prompts(cfg, tokenizer)
