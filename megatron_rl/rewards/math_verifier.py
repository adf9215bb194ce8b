"""MATH-style answer equivalence through the ``math-verify`` library: 1.0 when the model's final
answer equals the reference as mathematics (``\\frac{1}{2}`` = ``0.5`` = ``1/2``, intervals,
sets, LaTeX, units and degrees dropped), else 0.0.

The final answer is the last ``\\boxed{...}`` of the completion; without one, math-verify's own
extraction reads the end of the text ("the answer is 5", a last ``$...$``, a last number).

Model output is hostile input: sympy evaluates integer powers and factorials eagerly and the
LaTeX parser recurses on nesting, so one short answer like ``9^{9^{9}}`` could hold a worker (and
the interpreter lock) for hours. Before anything is parsed the text is cut to its tail and the
answer is checked for what makes parsing or evaluation explode (nesting depth, huge exponents
and factorials, very long numbers); such an answer scores 0. math-verify's own timeouts (SIGALRM)
are off here: the reward pool kills the worker process of a call past ``reward.timeout_s``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional

# Characters of the completion's end that are searched for the answer (a boxed answer sits at the
# end; a 1 MB completion costs no more than this).
TAIL_CHARS = 4000
# Longest answer handed to the parser (the longest MATH-500 reference answer is under 200).
MAX_ANSWER_CHARS = 600
# Deepest nesting of {}, () and [] in an answer.
MAX_NESTING = 12
# Largest exponent, and largest product of the numbers around a factorial or binomial, that may be
# evaluated (bounded by the product of the numbers written there); the longest digit run.
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 1_000
MAX_DIGITS = 400

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# An exponent: a braced group, a parenthesised one, or one token (2^{3k+1}, 2**(10), 2^7, 2**100).
_EXPONENT = re.compile(r"(?:\^|\*\*)\s*(\{[^{}]*\}|\([^()]*\)|[\w.,]+)")
# An exponent that itself holds an exponent: 9^{9^{9}}, 2^(3^4), 2**3**4
_NESTED_POWER = re.compile(r"(?:\^|\*\*)\s*(?:\{[^{}]*(?:\^|\*\*)|\([^()]*(?:\^|\*\*)|[\w.]+\s*(?:\^|\*\*))")
# Functions sympy evaluates eagerly into huge integers: a factorial of a number (its operand is
# that number), of a bracket, or binomials and Gamma (their operands: every number around, and
# none may hold a power, which the product of the numbers does not bound).
_FACTORIAL_OF_NUMBER = re.compile(r"(\d[\d,]*)\s*!")
_COMBINATORIAL = re.compile(r"[)}\]]\s*!|\\[dt]?binom|\\choose|\\Gamma|factorial|binomial")
_LITERAL = re.compile(r"\d[\d,]*(?:\.\d+)?")
_DIGIT_RUN = re.compile(r"\d{%d,}" % (MAX_DIGITS + 1))


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox``) with balanced braces, else None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def unsafe_reason(answer: str) -> Optional[str]:
    """Why parsing or evaluating ``answer`` could explode (None when it is safe)."""
    if len(answer) > MAX_ANSWER_CHARS:
        return f"longer than {MAX_ANSWER_CHARS} characters"
    depth = deepest = 0
    for char in answer:
        if char in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})]":
            depth = max(0, depth - 1)
    if deepest > MAX_NESTING:
        return f"nested {deepest} deep"
    if _DIGIT_RUN.search(answer):
        return f"a number of more than {MAX_DIGITS} digits"
    if _NESTED_POWER.search(answer):
        return "a power inside an exponent"
    for match in _EXPONENT.finditer(answer):
        if _literal_product(match.group(1)) > MAX_EXPONENT:  # 2^{9999 \cdot 9999} as well as 2^{99999999}
            return f"an exponent above {MAX_EXPONENT}"
    if any(_number(m.group(1)) > MAX_FACTORIAL for m in _FACTORIAL_OF_NUMBER.finditer(answer)) or (
            _COMBINATORIAL.search(answer) and (_literal_product(answer) > MAX_FACTORIAL
                                               or "^" in answer or "**" in answer)):
        return f"a factorial or binomial of numbers above {MAX_FACTORIAL}"
    return None


def _literal_product(text: str) -> float:
    """Product of the numbers written in ``text`` (each counted as at least 2): a bound on what
    sums and products of them can reach."""
    product = 1.0
    for literal in _LITERAL.findall(text):
        product *= max(_number(literal), 2.0)
        if product > 1e300:
            return float("inf")
    return product


def _number(text: str) -> float:
    try:
        return abs(float(text.replace(",", "")))
    except ValueError:
        return float("inf")


@lru_cache(maxsize=None)
def _quiet_math_verify() -> None:
    """math-verify warns once that its timeouts are off; here the reward pool's timeout is on."""
    import math_verify.grader
    import math_verify.parser

    math_verify.grader.TIMEOUT_WARNING_SHOWN = math_verify.parser.TIMEOUT_WARNING_SHOWN = True


@lru_cache(maxsize=4096)
def _parse_reference(target: str):
    """The reference answer, parsed once per distinct target (every sample of a group shares it)."""
    from math_verify import parse

    return parse("\\boxed{" + target + "}", parsing_timeout=None)


def math_equal(completion: str, target: str) -> float:
    """1.0 when the completion's final answer is mathematically equal to ``target`` (a MATH
    reference answer in LaTeX, e.g. ``\\frac{14}{3}``), else 0.0."""
    from math_verify import parse, verify

    _quiet_math_verify()
    if not target.strip():
        raise ValueError("math_equal needs a non-empty reference answer")
    tail = completion[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    if boxed is not None:
        answer, text = boxed, "\\boxed{" + boxed + "}"
    else:
        # No box: the last lines, where "the answer is ..." or a last number would be.
        text = answer = tail[-MAX_ANSWER_CHARS:]
    if not answer.strip() or unsafe_reason(answer) is not None:
        return 0.0
    gold = _parse_reference(target)
    predicted = parse(text, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return float(verify(gold, predicted, timeout_seconds=None))
