"""Countdown reward: reach `target` with `numbers` and + - * / (the TinyZero / "Countdown-Tasks" game).

The expression is parsed with `ast` and evaluated over exact fractions by a tiny interpreter that
knows only integer literals, the four binary operators and parentheses; nothing the model wrote is
ever passed to `eval`. Division is exact (7 / 2 is 7/2, not 3), so a solution cannot lean on
float rounding, and division by zero is a wrong answer.

Where the expression is read from, in order:
  1. the last `<answer>...</answer>` block,
  2. else the last `\\boxed{...}`,
  3. else the last non-empty line.
All `<answer>` blocks (or all boxes) must agree, like `extract_answer` for math: several different
final answers are no answer, and so are `<answer>` tags that do not pair up (one left open, a
closing without an opening, a block inside a block). Tags are paired in one pass (`tag_blocks`):
a megabyte of unclosed tags costs milliseconds. The expression may be written as an equation,
`(3 + 5) * 2 = 16`: every right-hand side must then evaluate to the target.

Unary minus is not an operator of the game and is rejected, as are decimals, names, `**` and
digits other than ASCII 0-9. Malformed example fields (`numbers`, `target`) make that sample None;
no completion text makes this raise.
"""

from __future__ import annotations

import ast
import numbers as _numbers
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from grpo_jax.rewards.format import tag_blocks
from grpo_jax.rewards.math import boxed_contents

# Checked before parsing: ASCII digits, spaces, + - * / and parentheses; no names, dots, underscores.
_ALLOWED_CHARS = re.compile(r"[0-9 \t\r\n+\-*/()]+")
_MAX_EXPRESSION_CHARS = 200  # a real solution is a few dozen characters; bounds parser work and nesting
_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__, ast.Div: Fraction.__truediv__}


def extract_expression(completion: str) -> str | None:
    """The expression the completion commits to (see the module docstring), or None."""
    blocks = tag_blocks(completion, "answer")
    if blocks is None:
        return None  # <answer> tags that do not pair up: the completion tried to commit and failed
    tagged = [content.strip() for _, _, content in blocks]
    if not tagged:
        tagged = [b.strip() for b in boxed_contents(completion)]
    if tagged:
        return tagged[-1] if len(set(tagged)) == 1 else None
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def _evaluate(node: ast.AST, literals: list[int]) -> Fraction:
    """Value of an allowed expression node; collects the integer literals it uses. Raises
    ValueError for anything outside the game (and ZeroDivisionError for x / 0)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _evaluate(node.left, literals)
        right = _evaluate(node.right, literals)
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} is not allowed in a countdown expression")


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integer literals used) of an expression of integers, + - * / and parentheses,
    or None when it is not one (or divides by zero)."""
    if len(expression) > _MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        literals: list[int] = []
        return _evaluate(tree.body, literals), literals
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def _as_int(value: object) -> int | None:
    """An int from an int-like gold value (Python or NumPy integer, not bool), else None."""
    if isinstance(value, _numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    return None


def countdown_reward(prompts: Sequence[str], completions: Sequence[str], *, numbers: Sequence[Sequence[int]],
                     target: Sequence[int], use_all_numbers: bool = False, **_: object) -> list[float | None]:
    """1.0 if the completion's expression equals `target` exactly using only the given numbers,
    0.0 if not, None if the example's `numbers`/`target` are malformed (not a list of ints / not
    an int: a data problem, not the model's mistake).

    Each given number may be used at most once (a repeated number in `numbers` may be used as
    many times as it is given). With `use_all_numbers=True` every number must be used exactly
    once, as in TinyZero's Countdown-Tasks scoring; the default follows the game's rules, where a
    subset is allowed.
    """
    if not (len(prompts) == len(completions) == len(numbers) == len(target)):
        raise ValueError(f"lengths differ: {len(prompts)} prompts, {len(completions)} completions, "
                         f"{len(numbers)} numbers, {len(target)} targets")
    out: list[float | None] = []
    for completion, given, goal in zip(completions, numbers, target):
        given_ints, goal_int = _given_ints(given), _as_int(goal)
        if given_ints is None or goal_int is None:
            out.append(None)
            continue
        out.append(1.0 if _solves(completion, Counter(given_ints), goal_int, use_all_numbers) else 0.0)
    return out


def _given_ints(given: object) -> list[int] | None:
    """The given numbers as ints: a non-empty list, tuple or 1-D array of int-like values, else None."""
    if isinstance(given, np.ndarray) and given.ndim != 1:
        return None
    if not isinstance(given, (list, tuple, np.ndarray)) or len(given) == 0:
        return None
    ints = [_as_int(v) for v in given]
    return None if any(v is None for v in ints) else ints


def _solves(completion: str, given: Counter, goal: int, use_all_numbers: bool) -> bool:
    expression = extract_expression(completion)
    if expression is None:
        return False
    left, *right_sides = expression.split("=")
    for rhs in right_sides:
        value = evaluate_expression(rhs)
        if value is None or value[0] != goal:
            return False
    evaluated = evaluate_expression(left)
    if evaluated is None:
        return False
    value, used = evaluated
    used_counts = Counter(used)
    if use_all_numbers and used_counts != given:
        return False
    if any(used_counts[n] > given[n] for n in used_counts):
        return False
    return value == goal
