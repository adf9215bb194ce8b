"""Code reward: the completion's program runs against test cases in the sandbox.

A target is a JSON list of test cases, each ``{"input": <stdin>, "output": <expected stdout>}``
(compared after stripping trailing whitespace on each line). The program is the last fenced
```python block of the completion, or the whole completion when it has none.

Verdict of one completion: ``pass`` (every case's output right), ``wrong_answer``, ``timeout``,
``crash`` or ``memory`` (the first failing case decides); reward 1.0 for pass, else 0.0.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
# Tests one completion may run (a target with more is cut, so one prompt cannot hold a worker
# for hours).
MAX_CASES = 32


@dataclass
class CodeVerdict:
    # pass | wrong_answer | timeout | crash | memory
    verdict: str
    # Test cases run and passed before the verdict was reached.
    passed: int
    total: int

    @property
    def reward(self) -> float:
        return 1.0 if self.verdict == "pass" else 0.0


def extract_program(completion: str) -> str:
    """The last fenced python block of ``completion``, or all of it when it has none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def parse_cases(target: str) -> List[dict]:
    """The test cases of a target; ValueError naming what is wrong."""
    try:
        cases = json.loads(target)
    except json.JSONDecodeError as err:
        raise ValueError(f"a code target must be a JSON list of {{'input', 'output'}} cases ({err.msg})") from None
    if not isinstance(cases, list) or not cases or not all(
            isinstance(c, dict) and isinstance(c.get("input", ""), str) and isinstance(c.get("output"), str)
            for c in cases):
        raise ValueError("a code target must be a non-empty JSON list of {'input': str, 'output': str} cases")
    return cases[:MAX_CASES]


def _same_output(got: str, expected: str) -> bool:
    def lines(text: str) -> List[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(got) == lines(expected)


async def judge(program: str, cases: Sequence[dict], limits: Optional[SandboxLimits] = None) -> CodeVerdict:
    """Run ``program`` on each case in turn, stopping at the first that fails."""
    for passed, case in enumerate(cases):
        result = await run_python(program, case.get("input", ""), limits)
        if result.status != "ok":
            return CodeVerdict(result.status, passed, len(cases))
        if not _same_output(result.stdout, case["output"]):
            return CodeVerdict("wrong_answer", passed, len(cases))
    return CodeVerdict("pass", len(cases), len(cases))


def code_tests(completion: str, target: str) -> float:
    """Reward: 1.0 when the completion's program passes every test case of ``target``.

    Runs in a reward worker process (no event loop there), one sandboxed process per case."""
    cases = parse_cases(target)
    return asyncio.run(judge(extract_program(completion), cases)).reward
