"""A synthetic multi-step arithmetic task (``data.name=arithmetic``) that needs no download.

A prompt is an expression of small whole numbers and ``+ - *`` ended by ``=``; its row's worked
solution does one operation per step, multiplications first, then left to right, and boxes the
value, which is the answer the ``math`` reward checks::

    <bos>3+4*2-5=   ->   4*2=8 3+8=11 11-5=6 \\boxed{6}<eos>

SFT trains on the worked solution (``Prompt.ground_truth``, what rollout/dataset_responses.py
reads); RL and eval score the boxed value (``Prompt.target``).

Prompts are drawn from ``trainer.seed``, so a seed always gives the same stream. The held-out split
is fixed by the expression alone (a hash), not by the seed: every expression belongs to exactly one
of ``train`` and ``eval``, so no training prompt of any run is ever an eval problem.
"""

from __future__ import annotations

import hashlib
import random
from typing import Iterator, List, Tuple

from .datasets import Prompt
from .files import DatasetError
from .tokenizer import Tokenizer
from ..errors import ConfigError

OPERATORS = "+-*"
# Every character a prompt or a worked solution holds (the char tokenizer's alphabet).
ALPHABET = "0123456789" + OPERATORS + "= \\boxed{}"
SPLITS = ("train", "eval")
# One expression in this many is held out for eval (about 12%).
HELD_OUT_ONE_IN = 8
# Draws tried for one expression of a split before the split counts as empty at these settings.
DRAWS_PER_EXPRESSION = 100_000


def is_held_out(expression: str) -> bool:
    """Whether ``expression`` (``3+4*2``, no ``=``) is an eval problem: a hash of its text, the same
    in every run, seed and process."""
    digest = hashlib.sha256(expression.encode()).digest()
    return int.from_bytes(digest[:8], "little") % HELD_OUT_ONE_IN == 0


def _apply(left: int, operator: str, right: int) -> int:
    return left * right if operator == "*" else left + right if operator == "+" else left - right


def worked_solution(expression: str) -> Tuple[str, int]:
    """The step-by-step solution of ``expression`` and its value: each step ``a*b=c`` reduces one
    operation, multiplications first (left to right), then additions and subtractions left to
    right; the value is boxed at the end."""
    numbers: List[int] = []
    operators: List[str] = []
    current = ""
    for char in expression:
        if char.isdigit():
            current += char
        else:
            numbers.append(int(current))
            operators.append(char)
            current = ""
    numbers.append(int(current))
    steps: List[str] = []
    for precedence in ("*", "+-"):
        i = 0
        while i < len(operators):
            if operators[i] not in precedence:
                i += 1
                continue
            value = _apply(numbers[i], operators[i], numbers[i + 1])
            steps.append(f"{numbers[i]}{operators[i]}{numbers[i + 1]}={value}")
            numbers[i:i + 2] = [value]
            del operators[i]
    value = numbers[0]
    steps.append(f"\\boxed{{{value}}}")
    return " ".join(steps), value


class ArithmeticTask:
    """Endless prompts of ``split`` (train or eval), ``min_ops``..``max_ops`` operations over
    numbers 0..``max_operand``, drawn with ``seed``."""

    def __init__(self, tokenizer: Tokenizer, min_ops: int, max_ops: int, max_operand: int, operators: str,
                 seed: int, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
        self.tokenizer = tokenizer
        self.min_ops, self.max_ops, self.max_operand = min_ops, max_ops, max_operand
        self.operators = operators
        self.split = split
        self.rng = random.Random(seed)

    def expression(self) -> str:
        """The next expression of this split (drawn until one of the split comes up)."""
        for _ in range(DRAWS_PER_EXPRESSION):
            ops = self.rng.randint(self.min_ops, self.max_ops)
            text = str(self.rng.randint(0, self.max_operand))
            for _ in range(ops):
                text += self.rng.choice(self.operators) + str(self.rng.randint(0, self.max_operand))
            if is_held_out(text) == (self.split == "eval"):
                return text
        raise DatasetError(f"data.name=arithmetic has no {self.split} problems with data.arithmetic_max_ops="
                           f"{self.max_ops}, data.arithmetic_max_operand={self.max_operand} and "
                           f"data.arithmetic_operators={self.operators!r}: raise those keys")

    def prompt(self, expression: str, uid: str) -> Prompt:
        solution, value = worked_solution(expression)
        text = expression + "="
        row = {"question": text, "solution": solution, "answer": str(value)}
        return Prompt(uid, text, self.tokenizer.prompt_ids(text), str(value), text, ground_truth=solution, row=row)

    def __iter__(self) -> Iterator[Prompt]:
        n = 0
        while True:
            yield self.prompt(self.expression(), f"arithmetic-{self.split}-{n}")
            n += 1


def check_arithmetic(data_cfg) -> None:
    """data.arithmetic_* make expressions, and the longest of them fits data.max_prompt_tokens."""
    d = data_cfg
    if not 1 <= d.arithmetic_min_ops <= d.arithmetic_max_ops:
        raise ConfigError(f"data.arithmetic_min_ops={d.arithmetic_min_ops} and data.arithmetic_max_ops="
                          f"{d.arithmetic_max_ops} must satisfy 1 <= min <= max (e.g. 1 and 2)")
    if d.arithmetic_max_operand < 1:
        raise ConfigError(f"data.arithmetic_max_operand={d.arithmetic_max_operand} must be >= 1 (e.g. 9)")
    ops = d.arithmetic_operators
    if not ops or set(ops) - set("+-*") or len(set(ops)) != len(ops):
        raise ConfigError(f"data.arithmetic_operators={ops!r} must be some of +, - and * once each (e.g. '+-*')")
    # <bos>, every number at its widest, the operators and '='.
    longest = 1 + (d.arithmetic_max_ops + 1) * len(str(d.arithmetic_max_operand)) + d.arithmetic_max_ops + 1
    if longest > d.max_prompt_tokens:
        raise ConfigError(f"data.name=arithmetic's longest prompt is {longest} tokens, more than data.max_prompt_tokens="
                          f"{d.max_prompt_tokens}: raise data.max_prompt_tokens to {longest} or lower "
                          "data.arithmetic_max_ops")
