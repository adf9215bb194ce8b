"""Where a dataset row keeps its prompt, its answer and its system prompt, and what they become.

A row's prompt is a string or a list of chat messages (``[{"role": ..., "content": ...}]``, as
verl's parquet files and chat datasets hold it). Its answer is a string, a number, or a list:
a list of plain values (strings, numbers) is several acceptable answers; a list or dict holding
lists or dicts (e.g. code test cases) is one structured answer, passed on as JSON text.
Field names may be dotted to reach into nested columns (``reward_model.ground_truth``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .files import DatasetError

# Tried in order when data.prompt_key is not set (after the named dataset's own field).
PROMPT_CANDIDATES = ("question", "prompt", "messages", "problem")
# Tried in order when data.answer_key is not set: ours, verl's, then a plain ground_truth column,
# then the response columns of supervised (SFT) data.
ANSWER_CANDIDATES = ("answer", "reward_model.ground_truth", "ground_truth", "response", "completion")
# The answer key of chat rows whose messages end with the assistant's reply (SFT data): the reply is
# the answer, the messages before it the prompt.
ASSISTANT_REPLY = "<the last assistant message>"
_MISSING = object()


def lookup(row: Dict[str, Any], key: str) -> Any:
    """``row[key]``, or for a dotted key the nested value (``reward_model.ground_truth``); a column
    whose own name holds the dot wins. ``_MISSING`` when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def has(row: Dict[str, Any], key: str) -> bool:
    return lookup(row, key) is not _MISSING


def detect_key(first_row: Dict[str, Any], configured: Optional[str], candidates: Sequence[str], what: str,
               config_key: str, where: str) -> str:
    """The field a file keeps its ``what`` in: ``configured`` when set, else the first candidate
    the first row has."""
    if configured:
        return configured
    for key in candidates:
        if has(first_row, key):
            return key
    raise DatasetError(f"{where}: no {what} field (looked for {', '.join(candidates)}; the row has: "
                       f"{', '.join(sorted(first_row)) or 'nothing'}); set {config_key}=<field> (dotted for a "
                       "nested one, e.g. reward_model.ground_truth)")


def required(row: Dict[str, Any], key: str, where: str) -> Any:
    value = lookup(row, key)
    if value is _MISSING:
        raise DatasetError(f"{where}: missing field {key!r} (row has: {', '.join(sorted(row)) or 'nothing'}); set "
                           "data.prompt_key/data.answer_key to the right field names")
    return value


Messages = List[Dict[str, str]]


def prompt_content(value: Any, key: str, where: str) -> "str | Messages":
    """A row's prompt: its non-empty text, or its chat messages checked to be ``{role, content}``
    objects with string values."""
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, list) and value:
        for i, message in enumerate(value):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DatasetError(f"{where}: field {key!r}: message {i} is {json.dumps(message)[:80]}, not "
                                   "{\"role\": <text>, \"content\": <text>}; fix that row")
        return [{**m} for m in value]
    raise DatasetError(f"{where}: field {key!r} must be a non-empty string or a list of chat messages "
                       f"({{role, content}}), got {json.dumps(value)[:60]}; fix that row")


def question_of(messages: Messages) -> str:
    """What the prompt asks: its last user message (what an agent is handed as ``question``)."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else messages[-1]["content"]


def with_system(messages: Messages, system: Optional[str]) -> Messages:
    """``messages`` behind a system message of ``system`` text, unless they open with their own."""
    if not system or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


def system_text(row: Dict[str, Any], system_key: Optional[str], system_prompt: Optional[str], where: str) -> Optional[str]:
    """The system prompt of a row: its ``data.system_key`` field when set and non-empty, else
    ``data.system_prompt``."""
    if system_key:
        value = lookup(row, system_key)
        if value is _MISSING:
            raise DatasetError(f"{where}: missing field {system_key!r} (data.system_key; row has: "
                               f"{', '.join(sorted(row))}); fix the row or unset data.system_key")
        if value is not None and not isinstance(value, str):
            raise DatasetError(f"{where}: field {system_key!r} (data.system_key) must be text, got "
                               f"{type(value).__name__}; fix that row")
        if value and value.strip():
            return value.strip()
    return system_prompt or None


def _scalar_text(value: Any) -> Optional[str]:
    """A plain answer value as text (``42``, ``0.5``, ``7/2``); None for anything else."""
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str) and value.strip():
        return value
    return None


def answer_targets(value: Any, key: str, where: str) -> Tuple[str, ...]:
    """The acceptable answers a row's answer field gives, as text, the first the main one: one for
    a string, a number or a structured value (JSON text), each item for a list of plain values."""
    text = _scalar_text(value)
    if text is not None:
        return (text,)
    if isinstance(value, list) and value and all(not isinstance(v, (list, dict)) for v in value):
        texts = [_scalar_text(v) for v in value]
        if None in texts:
            raise DatasetError(f"{where}: field {key!r}: item {texts.index(None)} of the answer list is empty; every "
                               "acceptable answer must be a non-empty string or a number")
        return tuple(texts)
    if isinstance(value, (list, dict)) and value:
        return (json.dumps(value, ensure_ascii=False),)
    raise DatasetError(f"{where}: field {key!r} must be a non-empty string, a number or a list of acceptable answers, "
                       f"got {json.dumps(value)[:60]}; fix that row")


@dataclass(frozen=True)
class RowFields:
    """The fields of one data source: prompt, answer, system prompt (None: detected / unset)."""

    prompt_key: Optional[str] = None
    answer_key: Optional[str] = None
    system_key: Optional[str] = None
    system_prompt: Optional[str] = None

    def resolved(self, first_row: Dict[str, Any], default_prompt_key: str, where: str) -> "RowFields":
        """These fields with the prompt and answer keys found in ``first_row`` where not given."""
        prompts = (default_prompt_key, *[k for k in PROMPT_CANDIDATES if k != default_prompt_key])
        prompt_key = detect_key(first_row, self.prompt_key, prompts, "prompt", "data.prompt_key", where)
        if self.answer_key is None and not any(has(first_row, k) for k in ANSWER_CANDIDATES) \
                and ends_with_reply(lookup(first_row, prompt_key)):
            return RowFields(prompt_key, ASSISTANT_REPLY, self.system_key, self.system_prompt)
        return RowFields(prompt_key,
                         detect_key(first_row, self.answer_key, ANSWER_CANDIDATES, "answer", "data.answer_key", where),
                         self.system_key, self.system_prompt)


def ends_with_reply(value: Any) -> bool:
    """Whether a prompt field is a chat whose last message is the assistant's."""
    return isinstance(value, list) and bool(value) and isinstance(value[-1], dict) \
        and value[-1].get("role") == "assistant"


def prompt_and_answer(row: Dict[str, Any], fields: "RowFields", where: str) -> Tuple[Any, Any]:
    """A row's prompt content and raw answer; chat rows that end with the assistant's reply
    (``ASSISTANT_REPLY``) give the messages before it and the reply."""
    content = prompt_content(required(row, fields.prompt_key, where), fields.prompt_key, where)
    if fields.answer_key != ASSISTANT_REPLY:
        return content, required(row, fields.answer_key, where)
    if not ends_with_reply(content) or len(content) < 2:
        raise DatasetError(f"{where}: field {fields.prompt_key!r} must end with the assistant's reply after at least "
                           "one other message (the other rows do); fix that row or set data.answer_key")
    return content[:-1], content[-1]["content"]
