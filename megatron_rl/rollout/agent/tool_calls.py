"""Tool calls in the model's text, Qwen/Hermes style, and the OpenAI fields they become.

The model writes a call as ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>`` (any
whitespace around the JSON); the chat template renders the tool list into the prompt and past
calls back into the history. A block whose JSON does not parse, or lacks a string ``name``,
stays in the text as content: the model's output is never silently dropped."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Dict, List, Tuple

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> Tuple[str, List[Dict[str, Any]]]:
    """(content without the parsed blocks, OpenAI ``tool_calls``) of one completion's text."""
    calls: List[Dict[str, Any]] = []
    kept: List[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", {})
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"],
                                   "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def messages_for_template(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """OpenAI messages as chat templates expect them: a tool call's ``arguments`` as an object
    (the API carries it as a JSON string) and ``content`` None as the empty string."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        elif isinstance(message["content"], list):  # content parts: the text ones joined
            message["content"] = "".join(p.get("text", "") for p in message["content"] if isinstance(p, dict))
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call = dict(call)
                function = dict(call.get("function", {}))
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        pass  # rendered as the string it is
                call["function"] = function
                calls.append(call)
            message["tool_calls"] = calls
        out.append(message)
    return out
