"""Prompt sources: synthetic digit tasks (generated, endless) and JSONL datasets such as GSM8K.

Bad input fails early with one line naming the file, the line and the fix.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from ..errors import UserError
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class DatasetError(UserError):
    """A dataset file that cannot be used; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Prompt:
    uid: str
    text: str
    prompt_ids: List[int]
    # Ground truth the reward compares against (the reversed digits, the GSM8K final answer).
    target: str
    # The dataset's question before any template (what an agent workflow hands the agent).
    question: str = ""


def read_jsonl(path: str, required: Sequence[str]) -> List[Dict]:
    """Rows of a JSONL file, each checked to hold the required string fields."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"data.path={path!r}: file not found (GSM8K ships at "
                           "../shared/data/gsm8k/train.jsonl; pass data.path=<file>)")
    rows = []
    with file.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                   f"{err.start + 1}); convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8 "
                                   f"{path} > fixed.jsonl") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); "
                                   "fix or delete that line") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in required:
                if key not in row:
                    raise DatasetError(f"{path}:{lineno}: missing field {key!r} (row has: "
                                       f"{', '.join(sorted(row)) or 'nothing'}); set data.prompt_key/"
                                       "data.answer_key to the right field names")
                if not isinstance(row[key], str) or not row[key].strip():
                    raise DatasetError(f"{path}:{lineno}: field {key!r} must be a non-empty string")
            rows.append(row)
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
# A template's user message when it goes through a chat template (the assistant turn follows, so
# no trailing "Answer:").
CHAT_MESSAGES = {
    "plain": "{question}",
    "qa": "{question}\nLet's think step by step and end with '#### <number>'.",
    "math": "{question}\nLet's think step by step and put the final answer in \\boxed{{}}.",
}


def render_prompt(template: str, question: str, tokenizer: Tokenizer, chat: bool = False) -> str:
    """The prompt text of one question under ``data.template``; ``chat``: as one user message
    through the tokenizer's chat template (data.apply_chat_template)."""
    if chat and template != CHAT:
        message = CHAT_MESSAGES[template].format(question=question)
        return tokenizer.chat_template.render([{"role": "user", "content": message}], add_generation_prompt=True)
    if template != CHAT:
        return TEMPLATES[template].format(question=question)
    if tokenizer.chat_template is None:
        raise DatasetError("data.template=chat needs a chat template, and this tokenizer has none: use "
                           "data.tokenizer=model with a model.path whose tokenizer_config.json has a "
                           "chat_template, or data.template=plain|qa")
    return tokenizer.chat_template.render([{"role": "user", "content": question}], add_generation_prompt=True)

# The prompt field of each named JSONL dataset (data.prompt_key overrides it).
PROMPT_KEYS = {"gsm8k": "question", "math500": "problem", "jsonl": "question"}


def prompt_key(name: str, configured: Optional[str]) -> str:
    """The field holding the prompt: ``data.prompt_key`` when set, else the dataset's own."""
    return configured or PROMPT_KEYS.get(name, "question")


class JsonlPrompts:
    """Epochs over a JSONL dataset, shuffled per epoch with the run's seed."""

    def __init__(self, path: str, tokenizer: Tokenizer, prompt_key: str, answer_key: str,
                 template: str, max_prompt_tokens: int, seed: int, shuffle: bool = True,
                 gsm8k: bool = False, chat: bool = False):
        rows = read_jsonl(path, [prompt_key, answer_key])
        self.prompts: List[Prompt] = []
        too_long = 0
        for i, row in enumerate(rows):
            target = row[answer_key]
            if gsm8k:
                try:
                    target = gsm8k_final_answer(target)
                except ValueError as err:
                    raise DatasetError(f"{path}:{i + 1}: field {answer_key!r}: {err}") from None
            question = row[prompt_key].strip()
            text = render_prompt(template, question, tokenizer, chat)
            ids = tokenizer.encode(text) if template == CHAT or chat else tokenizer.prompt_ids(text)
            if len(ids) > max_prompt_tokens:
                too_long += 1
                continue
            self.prompts.append(Prompt(f"{Path(path).stem}-{i}", text, ids, target, question))
        if too_long:
            logger.warning("%s: skipped %d of %d prompts longer than data.max_prompt_tokens=%d",
                           path, too_long, len(rows), max_prompt_tokens)
        if not self.prompts:
            raise DatasetError(f"{path}: every prompt exceeds data.max_prompt_tokens={max_prompt_tokens}")
        self.rng = random.Random(seed)
        self.shuffle = shuffle

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                self.rng.shuffle(order)
            for i in order:
                yield self.prompts[i]


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
