"""Prompt sources: synthetic digit tasks (generated, endless) and datasets read from a file
(JSONL, parquet or a Hugging Face ``datasets`` directory; files.py reads them, fields.py finds
the prompt and answer in a row).

Bad input fails early with one line naming the file, the row and the fix.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .chat_template import ChatTemplateError
from .fields import (Messages, RowFields, answer_targets, prompt_and_answer, question_of, system_text,
                     with_system)
from .files import DatasetError, dataset_format, read_jsonl_rows, read_rows
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["CHAT", "DatasetError", "DatasetPrompts", "DigitTask", "Prompt", "TEMPLATES", "read_jsonl",
           "render_prompt"]


@dataclass(frozen=True)
class Prompt:
    uid: str
    text: str
    prompt_ids: List[int]
    # Ground truth the reward compares against (the reversed digits, the GSM8K final answer).
    target: str
    # The dataset's question before any template (what an agent workflow hands the agent).
    question: str = ""
    # Every acceptable answer as text when the row gave several (a list); target is the first.
    # Empty: target alone.
    answers: Tuple[str, ...] = field(default=(), hash=False)
    # The answer as the row holds it (a number, a list, text), for rewards that take it raw
    # (verl's ground_truth); None: target.
    ground_truth: Any = field(default=None, hash=False)
    # Every column of the dataset row (JSON values), for rewards and agents that read other fields.
    row: Dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def acceptable_answers(self) -> Tuple[str, ...]:
        return tuple(self.answers) or (self.target,)


def read_jsonl(path: str, required_fields: Sequence[str]) -> List[Dict]:
    """Rows of a JSONL file, each checked to hold the required string fields."""
    dataset_format(path)  # file not found: one line
    rows = read_jsonl_rows(path)
    for lineno, row in enumerate(rows, start=1):
        for key in required_fields:
            if key not in row:
                raise DatasetError(f"{path}:{lineno}: missing field {key!r} (row has: "
                                   f"{', '.join(sorted(row)) or 'nothing'}); set data.prompt_key/"
                                   "data.answer_key to the right field names")
            if not isinstance(row[key], str) or not row[key].strip():
                raise DatasetError(f"{path}:{lineno}: field {key!r} must be a non-empty string")
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def gsm8k_final_answer(answer: str) -> str:
    """The number after GSM8K's ``####`` marker, without thousands separators."""
    if "####" not in answer:
        raise ValueError("GSM8K answers end with '#### <number>'")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


TEMPLATES = {
    "plain": "{question}",
    "qa": "Question: {question}\nLet's think step by step and end with '#### <number>'.\nAnswer:",
    "math": "Problem: {question}\nLet's think step by step and put the final answer in \\boxed{{}}.\nSolution:",
}
# data.template=chat: the question as one user message through the tokenizer's chat template.
CHAT = "chat"
# A template's user message when it goes through a chat template (data.apply_chat_template; the
# assistant turn follows, so no trailing "Answer:").
CHAT_MESSAGES = {
    "plain": "{question}",
    "qa": "{question}\nLet's think step by step and end with '#### <number>'.",
    "math": "{question}\nLet's think step by step and put the final answer in \\boxed{{}}.",
}
NO_CHAT_TEMPLATE_FIX = ("use data.tokenizer=model with a model.path (or data.tokenizer_path) whose "
                        "tokenizer_config.json has a chat_template")


def render_messages(messages: Messages, tokenizer: Tokenizer, where: str) -> str:
    """Chat messages as prompt text through the tokenizer's chat template."""
    if tokenizer.chat_template is None:
        raise DatasetError(f"{where}: the prompt is a list of chat messages, rendered through the tokenizer's chat "
                           f"template, and this tokenizer has none: {NO_CHAT_TEMPLATE_FIX}")
    try:
        return tokenizer.chat_template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as err:
        raise DatasetError(f"{where}: {err}; fix the row's messages or the chat template") from None


def render_prompt(template: str, question: str, tokenizer: Tokenizer, system: Optional[str] = None,
                  chat: bool = False) -> str:
    """The prompt text of one question under ``data.template``: a chat template gets the system
    prompt as a system message, a text template has it in front, a blank line between. ``chat``:
    the template's text as one user message through the tokenizer's chat template
    (data.apply_chat_template)."""
    if chat and template != CHAT:
        message = CHAT_MESSAGES[template].format(question=question)
        return tokenizer.chat_template.render(with_system([{"role": "user", "content": message}], system),
                                              add_generation_prompt=True)
    if template != CHAT:
        text = TEMPLATES[template].format(question=question)
        return f"{system}\n\n{text}" if system else text
    if tokenizer.chat_template is None:
        raise DatasetError("data.template=chat needs a chat template, and this tokenizer has none: use "
                           "data.tokenizer=model with a model.path whose tokenizer_config.json has a "
                           "chat_template, or data.template=plain|qa")
    return tokenizer.chat_template.render(with_system([{"role": "user", "content": question}], system),
                                          add_generation_prompt=True)


# The prompt field of each named dataset (data.prompt_key overrides it; others are detected).
PROMPT_KEYS = {"gsm8k": "question", "math500": "problem", "jsonl": "question", "file": "question"}


def prompt_key(name: str, configured: Optional[str]) -> str:
    """The field holding the prompt: ``data.prompt_key`` when set, else the dataset's own."""
    return configured or PROMPT_KEYS.get(name, "question")


def row_location(path: str, kind: str, number: int) -> str:
    """``train.jsonl:3`` (the line of a JSONL file without blank lines), ``train.parquet row 3``."""
    return f"{path}:{number}" if kind == "jsonl" else f"{path} row {number}"


class DatasetPrompts:
    """Epochs over a dataset file, shuffled per epoch with the run's seed.

    ``prompt_key`` / ``answer_key`` None: found in the first row (``default_prompt_key`` first,
    then question, prompt, messages, problem; answer, reward_model.ground_truth, ground_truth)."""

    def __init__(self, path: str, tokenizer: Tokenizer, prompt_key: Optional[str], answer_key: Optional[str],
                 template: str, max_prompt_tokens: int, seed: int, shuffle: bool = True,
                 gsm8k: bool = False, system_key: Optional[str] = None, system_prompt: Optional[str] = None,
                 split: str = "train", default_prompt_key: str = "question", uid_prefix: Optional[str] = None,
                 chat: bool = False):
        kind = dataset_format(path)
        rows = read_rows(path, split)
        fields = RowFields(prompt_key, answer_key, system_key, system_prompt).resolved(
            rows[0], default_prompt_key, row_location(path, kind, 1))
        prefix = uid_prefix or Path(path).stem
        self.path = path
        self.prompts: List[Prompt] = []
        too_long = 0
        for i, row in enumerate(rows):
            where = row_location(path, kind, i + 1)
            prompt = self.prompt_of(row, fields, tokenizer, template, gsm8k, f"{prefix}-{i}", where, chat)
            if len(prompt.prompt_ids) > max_prompt_tokens:
                too_long += 1
                continue
            self.prompts.append(prompt)
        if too_long:
            logger.warning("%s: skipped %d of %d prompts longer than data.max_prompt_tokens=%d",
                           path, too_long, len(rows), max_prompt_tokens)
        if not self.prompts:
            raise DatasetError(f"{path}: every prompt exceeds data.max_prompt_tokens={max_prompt_tokens}")
        self.rng = random.Random(seed)
        self.shuffle = shuffle

    @staticmethod
    def prompt_of(row: Dict[str, Any], fields: RowFields, tokenizer: Tokenizer, template: str, gsm8k: bool,
                  uid: str, where: str, chat: bool = False) -> Prompt:
        """One row as a prompt: rendered, tokenized, its answer as target text; ``chat``: a text
        prompt goes through the chat template too."""
        content, raw_answer = prompt_and_answer(row, fields, where)
        answers = answer_targets(raw_answer, fields.answer_key, where)
        if gsm8k and isinstance(raw_answer, str):
            try:
                answers = (gsm8k_final_answer(raw_answer),)
            except ValueError as err:
                raise DatasetError(f"{where}: field {fields.answer_key!r}: {err}") from None
        system = system_text(row, fields.system_key, fields.system_prompt, where)
        if isinstance(content, list):
            question = question_of(content)
            text = render_messages(with_system(content, system), tokenizer, where)
            ids = tokenizer.encode(text)
        else:
            question = content
            text = render_prompt(template, question, tokenizer, system, chat)
            ids = tokenizer.encode(text) if template == CHAT or chat else tokenizer.prompt_ids(text)
        return Prompt(uid, text, ids, answers[0], question, answers if len(answers) > 1 else (), raw_answer, row)

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                self.rng.shuffle(order)
            for i in order:
                yield self.prompts[i]


# The name the class had while it read JSONL only (tests and tools still use it).
JsonlPrompts = DatasetPrompts


class DigitTask:
    """Endless synthetic prompts: ``<bos>d1..dn=``; the answer is the digits reversed or sorted."""

    def __init__(self, task: str, tokenizer: Tokenizer, digits: str, min_len: int, max_len: int, seed: int,
                 distinct: bool = False, length_tail: float = 0.0):
        if task not in ("reverse_digits", "sort_digits"):
            raise ValueError(f"unknown digit task {task!r}")
        self.task, self.tokenizer, self.digits = task, tokenizer, digits
        self.min_len, self.max_len = min_len, max_len
        self.distinct = distinct
        self.rng = random.Random(seed)
        self.length_tail = length_tail
        self.lengths = list(range(min_len, max_len + 1))
        # Power-law length weights (uniform when length_tail = 0).
        self.length_weights = [(n - min_len + 1) ** -length_tail for n in self.lengths]

    def target(self, s: str) -> str:
        return s[::-1] if self.task == "reverse_digits" else "".join(sorted(s))

    def __iter__(self) -> Iterator[Prompt]:
        n = 0
        while True:
            if self.length_tail:
                length = self.rng.choices(self.lengths, self.length_weights)[0]
            else:  # uniform (kept as randint so existing seeds give the same prompts)
                length = self.rng.randint(self.min_len, self.max_len)
            if self.distinct:
                s = "".join(self.rng.sample(sorted(set(self.digits)), length))
            else:
                s = "".join(self.rng.choice(self.digits) for _ in range(length))
            text = s + "="
            yield Prompt(f"{self.task}-{n}", text, self.tokenizer.prompt_ids(text), self.target(s), text)
            n += 1
