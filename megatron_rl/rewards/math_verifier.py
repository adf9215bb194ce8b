"""MATH-style answer equivalence through the ``math-verify`` library: 1.0 when the model's final
answer equals the reference as mathematics (``\\frac{1}{2}`` = ``0.5`` = ``1/2``, intervals,
sets, LaTeX, units and degrees dropped), else 0.0.

The final answer is the last ``\\boxed{...}`` of the completion, together with the boxes right
before it that only a separator parts from it (``\\boxed{2}, \\boxed{3}`` and ``\\boxed{2} and
\\boxed{3}`` answer "2, 3"); without one, math-verify's own extraction reads the end of the text
("the answer is 5", a last ``$...$``, a last number).

Two notations math-verify does not read are rewritten first, in the answer and the reference:
a repeating decimal (``0.\\overline{3}``, ``1.2\\overline{3}``, ``\\bar`` or ``\\dot``) becomes its
fraction, and a number with a percent sign (``50\\%``, ``50%``, ``50 percent``) equals that number
with or without the sign and its hundredth (``50\\%`` = ``50`` = ``0.5`` = ``\\frac12``), while two bare
numbers are compared as written (``50`` ≠ ``0.5``) and two percentages by their numbers.

Model output is hostile input: sympy evaluates integer powers and factorials eagerly and the
LaTeX parser recurses on nesting, so one short answer like ``9^{9^{9}}`` could hold a worker (and
the interpreter lock) for hours. Before anything is parsed the text is cut to its tail and the
answer is checked for what makes parsing or evaluation explode (nesting depth, huge exponents
and factorials, very long numbers); such an answer scores 0. math-verify's own timeouts (SIGALRM)
are off here: the reward pool kills the worker process of a call past ``reward.timeout_s``.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import List, Optional, Tuple

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
# Most boxes read as one answer list (math-verify joins up to six connected expressions).
MAX_BOXES = 6
# What may stand between two boxes of one answer list: spaces, $, commas, semicolons, "and", "or",
# LaTeX spacing, those inside \text{}, and a variable's name before the next box (x_2 = \boxed{3}).
_BOX_SEPARATOR = re.compile(r"(?:\s|\$|,|;|\band\b|\bor\b|\\[,;:! ]|\\q?quad\b|\b[a-zA-Z](?:_\{?\d+\}?)?\s*=|"
                            r"\\(?:text|mbox|textrm)\s*\{\s*(?:,|;|and|or)?\s*,?\s*\})*\Z")
# A repeating decimal: 0.\overline{3}, -1.2\overline{34}, .\bar{6}, 0.\dot{3}
_REPEATING = re.compile(r"(?<![\d.])(-?)(\d*)\.(\d*)\s*\\(?:overline|bar|dot)\s*(?:\{\s*(\d{1,%d})\s*\}|(\d))"
                        % MAX_DIGITS)
# A number with a percent sign: 50\%, 12.5%, 1,000 percent, 50\text{\%}
_PERCENT = re.compile(r"\s*([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+)\s*"
                      r"(?:\\?%|\\(?:text|mbox|textrm)\s*\{\s*(?:\\?%|percent|pct)\s*\}|percent|pct)\s*")


def _closing_brace(text: str, start: int) -> Optional[int]:
    """Index of the brace that closes the group opened just before ``start``, else None."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox``) with balanced braces, else None."""
    boxes = final_boxes(text)
    return boxes[-1] if boxes else None


def final_boxes(text: str) -> List[str]:
    """Contents of the last balanced ``\\boxed{...}`` and of the boxes before it that only a
    separator (spaces, ``$``, a comma, "and", "or") parts from it, in order; [] without a box."""
    matches = list(_BOXED.finditer(text))
    boxes: List[str] = []
    end = None  # where the text before the boxes found so far ends
    for match in reversed(matches):
        if end is not None and match.start() >= end:
            continue  # a box inside one already taken
        close = _closing_brace(text, match.end())
        if close is None:
            continue
        if end is not None and close > end:
            boxes = []  # a box around the ones taken: its content is the answer
        elif end is not None and not _BOX_SEPARATOR.match(text[close + 1:end]):
            break
        boxes.insert(0, text[match.end():close])
        end = match.start()
        if len(boxes) == MAX_BOXES:
            break
    return boxes


def repeating_to_fraction(text: str) -> str:
    """``text`` with every repeating decimal (``0.\\overline{3}``) written as its fraction."""
    def fraction(match: re.Match) -> str:
        sign, whole, fixed, repeat = match.group(1), match.group(2), match.group(3), match.group(4) or match.group(5)
        value = (Fraction(int(whole or "0")) + Fraction(int(fixed or "0"), 10 ** len(fixed))
                 + Fraction(int(repeat), (10 ** len(repeat) - 1) * 10 ** len(fixed)))
        if value.denominator == 1:
            return f"{sign}{value.numerator}"
        return f"{sign}\\frac{{{value.numerator}}}{{{value.denominator}}}"

    return _REPEATING.sub(fraction, text)


def percent_number(answer: str) -> Optional[str]:
    """The number of an answer that is only a number with a percent sign (``"12.5\\%"`` gives
    ``"12.5"``), else None."""
    match = _PERCENT.fullmatch(answer)
    return match.group(1).replace(",", "") if match else None


def _hundredth(number: str) -> str:
    return format(Decimal(number) / 100, "f")


def _readings(answer: str, target: str) -> List[Tuple[str, str]]:
    """The (answer, reference) pairs to compare: a percentage on one side only may be meant as its
    number or as its value (50\\% against 50 or 0.5); on both sides their numbers are compared."""
    answer_pct, target_pct = percent_number(answer), percent_number(target)
    if answer_pct is not None and target_pct is not None:
        return [(answer_pct, target_pct)]
    if answer_pct is not None:
        return [(answer_pct, target), (_hundredth(answer_pct), target)]
    if target_pct is not None:
        return [(answer, target_pct), (answer, _hundredth(target_pct))]
    return [(answer, target)]


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
    boxes = final_boxes(tail)
    boxed = bool(boxes)
    # No box: the last lines, where "the answer is ..." or a last number would be.
    answer = ", ".join(boxes) if boxed else tail[-MAX_ANSWER_CHARS:]
    if not answer.strip() or unsafe_reason(answer) is not None:
        return 0.0
    answer, target = repeating_to_fraction(answer), repeating_to_fraction(target.strip())
    for answer_reading, target_reading in _readings(answer, target):
        gold = _parse_reference(target_reading)
        predicted = parse("\\boxed{" + answer_reading + "}" if boxed else answer_reading, parsing_timeout=None)
        if gold and predicted and verify(gold, predicted, timeout_seconds=None):
            return 1.0
    return 0.0
