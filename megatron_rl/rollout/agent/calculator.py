"""Example agent: multi-turn math with a Python calculator tool run in the code sandbox.

Each turn the model may call ``python`` (``<tool_call>{"name": "python", "arguments": {"code":
"print(17 * 23)"}}</tool_call>``); the code runs in ``megatron_rl.rewards.sandbox`` and what it
printed comes back as the tool's answer. A turn without a tool call and without a final
``#### <number>`` gets a nudge, up to ``max_turns`` model turns (``rollout.agent_args.max_turns``).
The reward is GSM8K's exact match of the last ``####`` answer. It is an ordinary OpenAI-client
chat loop: the same code runs against any OpenAI-compatible server.

    rollout.workflow=calculator_agent   (or rollout.workflow=megatron_rl.rollout.agent.calculator:CalculatorAgent)
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

SYSTEM = ("You solve math problems. To compute, call the python tool with code that prints the result. "
          "End with the final answer as '#### <number>'.")
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
NUDGE = "Check with the python tool if needed, then give the final answer as '#### <number>'."


def tokenizer_texts() -> List[str]:
    """This agent's fixed texts, for training a tiny tokenizer that encodes them compactly."""
    from megatron_rl.data.tokenizer import CHATML_TEMPLATE

    return [SYSTEM, json.dumps(TOOLS), NUDGE, CHATML_TEMPLATE] * 20


async def run_python_tool(arguments: str, wall_s: float = 5.0) -> str:
    """The tool's answer to one call: stdout, or the error, of the code in the sandbox."""
    from megatron_rl.rewards.sandbox import SandboxLimits, run_python

    try:
        code = json.loads(arguments).get("code", "")
    except (json.JSONDecodeError, AttributeError):
        return "error: arguments must be a JSON object {\"code\": \"...\"}"
    if not isinstance(code, str) or not code.strip():
        return "error: no code given"
    result = await run_python(code, limits=SandboxLimits(wall_s=wall_s))
    if result.status != "ok":
        return f"error: {result.status} {result.stderr[-300:]}".strip()
    return result.stdout[-1000:] or "(nothing printed)"


class CalculatorAgent:
    """``async run(data, client) -> reward`` with the OpenAI client the trainer hands it;
    ``rollout.agent_args`` sets ``max_turns`` (model turns per run) and ``tool_wall_s`` (the
    seconds one tool call may run)."""

    # Its tool runs model-written code: the trainer checks the code sandbox's isolation at start.
    uses_sandbox = True

    def __init__(self, max_turns: int = 3, tool_wall_s: float = 5.0):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an integer of at least 1")
        if isinstance(tool_wall_s, bool) or not isinstance(tool_wall_s, (int, float)) or not tool_wall_s > 0:
            raise ValueError(f"tool_wall_s={tool_wall_s!r} must be a number of seconds above 0")
        self.max_turns, self.tool_wall_s = max_turns, float(tool_wall_s)

    async def run(self, data: Dict[str, Any], client) -> float:
        from openai import BadRequestError

        from megatron_rl.rewards.verifiers import gsm8k_exact

        messages: List[Dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": data["question"]}]
        answer = ""
        for _ in range(self.max_turns):
            try:
                response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            except BadRequestError:  # the conversation outgrew the model's context
                break
            message = response.choices[0].message
            answer = message.content or ""
            messages.append(message.model_dump(exclude_none=True))
            if message.tool_calls:
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": await run_python_tool(call.function.arguments,
                                                                                self.tool_wall_s)})
            elif "####" in answer:
                break
            else:
                messages.append({"role": "user", "content": NUDGE})
        return gsm8k_exact(answer, data["answer"])
