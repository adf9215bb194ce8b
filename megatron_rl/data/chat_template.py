"""A checkpoint's chat template (the Jinja2 source in its ``tokenizer_config.json``), rendered the
way Hugging Face tokenizers render it: sandboxed, ``trim_blocks``/``lstrip_blocks``, a
``raise_exception`` helper and a ``tojson`` that keeps non-ASCII text as it is."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template could not be compiled or refused the messages (its ``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    """``render(messages, tools, add_generation_prompt)`` -> the prompt text the model was trained on."""

    def __init__(self, source: str, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        self.source = source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template does not compile: {err}") from None
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: Sequence[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]] = None,
               add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=list(messages), tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed on these messages: {err}") from None
