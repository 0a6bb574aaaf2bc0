"""The `calculator` environment: the model writes an arithmetic expression in a tool call,
`<calculator>12345 * 678</calculator>` (or the chat template's JSON format: grpo_jax.env.tool_calls),
and the environment answers (role "tool") with its value or an error; a model turn without a tool
call is the final answer, which the run's `rewards` score.

The evaluator (`calculate`) parses with `ast` and walks an allow-list: numbers, + - * / // % **,
unary + and -, parentheses. Everything else (names, attributes, calls, subscripts, strings,
comparisons) is refused, and so are inputs over 200 characters, exponents whose result would pass
10^100, results past 10^300, and any value whose exact fraction would need more than 10,000 digits
in its numerator or denominator. A power whose exact value would (`(1 + 0.05/365) ** 3650`, or
`(1.0000001 ** 10000) ** 10000`, near e but 7 * 10^8 digits exactly) is rounded to 140 significant
digits instead, decided before it is computed: an evaluation takes milliseconds whatever the model
writes. Nothing is ever `eval`-ed. Values are exact (fractions) but for such powers, and printed as
integers or as decimals of up to 10 places.
"""

from __future__ import annotations

import ast
import decimal
import math
import operator
from fractions import Fraction

from grpo_jax.env.tool_calls import ToolEnvironment

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 300
MAX_POWER_DIGITS = 100
MAX_EXACT_DIGITS = 10_000  # of a value's numerator or denominator: bounds the cost of every operation
_MAX_EXACT_BITS = math.ceil(MAX_EXACT_DIGITS * math.log2(10))
_ROUNDED_DIGITS = MAX_POWER_DIGITS + 40  # significant digits of a power too long to hold exactly
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot compute (the message says why)."""


def _digits(x: Fraction) -> float:
    """log10 of |x| (0 for 0), computed without building a float of a huge number."""
    if x == 0:
        return 0.0
    return math.log10(abs(x.numerator)) - math.log10(x.denominator)


def _bits(x: Fraction) -> int:
    """The size of x's exact representation: the longer of its numerator and denominator, in bits."""
    return max(x.numerator.bit_length(), x.denominator.bit_length())


def _exact(x: Fraction) -> Fraction:
    if _bits(x) > _MAX_EXACT_BITS:
        raise CalculatorError(f"the exact value would have more than {MAX_EXACT_DIGITS} digits")
    return x


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are supported")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if abs(exponent) * max(abs(_digits(base)), 0.0) > MAX_POWER_DIGITS or abs(exponent) > 10_000:
        raise CalculatorError(f"the result of ** would have more than {MAX_POWER_DIGITS} digits")
    if abs(exponent) * _bits(base) > _MAX_EXACT_BITS:  # checked before computing: the power is one long C call
        # Too long to hold exactly ((1 + 0.05/365) ** 3650): rounded to _ROUNDED_DIGITS significant
        # digits, enough for the printed 10 places at any magnitude the check above lets through.
        with decimal.localcontext() as ctx:
            ctx.prec, ctx.Emax, ctx.Emin = _ROUNDED_DIGITS, decimal.MAX_EMAX, decimal.MIN_EMIN
            return Fraction((decimal.Decimal(base.numerator) / base.denominator) ** int(exponent))
    return base ** int(exponent)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if type(node.value) is float and not math.isfinite(node.value):
            raise CalculatorError("the number is too large")
        value = Fraction(str(node.value)) if type(node.value) is float else Fraction(node.value)
        if _digits(value) > MAX_RESULT_DIGITS:
            raise CalculatorError(f"a number has more than {MAX_RESULT_DIGITS} digits")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            result = _power(left, right)
        elif right == 0 and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
            raise CalculatorError("division by zero")
        else:
            result = Fraction(_BINARY[type(node.op)](left, right))
        if _digits(result) > MAX_RESULT_DIGITS:
            raise CalculatorError(f"the result has more than {MAX_RESULT_DIGITS} digits")
        return _exact(result)
    raise CalculatorError(f"{type(node).__name__} is not allowed: numbers, + - * / // % ** and parentheses only")


def format_value(x: Fraction) -> str:
    """An integer as is; otherwise a decimal rounded to 10 places, trailing zeros dropped."""
    if x.denominator == 1:
        return str(x.numerator)
    with decimal.localcontext() as ctx:
        ctx.prec = MAX_RESULT_DIGITS + 20
        text = format((decimal.Decimal(x.numerator) / x.denominator).quantize(decimal.Decimal("1e-10")), "f")
    return text.rstrip("0").rstrip(".")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text; CalculatorError (a ValueError) saying why not."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be text")
    expression = expression.strip()
    if not expression:
        raise CalculatorError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"not an arithmetic expression ({e.msg if isinstance(e, SyntaxError) else e})") from None
    try:
        return format_value(_value(tree.body))
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


class Calculator(ToolEnvironment):
    """One episode with the calculator tool (see the module docstring). `tag`: the tool call's tag
    (the function's name in the json format); `tool_format`: `tags` or `json`
    (grpo_jax.env.tool_calls)."""

    argument = "expression"
    description = "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses."

    def __init__(self, tag: str = "calculator", tool_format: str = "tags"):
        super().__init__(tag, tool_format, who="calculator")

    def run(self, expression: str) -> str:
        try:
            return calculate(expression)
        except CalculatorError as e:
            return f"error: {e}"
