"""`arithmetic`: "What is 37 + 48?" with a verifiable integer answer, generated from a seed."""

from __future__ import annotations

import dataclasses
import string
from typing import Any

import tensorflow_datasets as tfds

from grpo_jax.data._rng import StableRandom
from grpo_jax.data.synthetic import SyntheticBuilder, SyntheticConfig

OPS = ("+", "-", "*", "/")


@dataclasses.dataclass(eq=False)
class ArithmeticConfig(SyntheticConfig):
    """One binary operation per question.

    Operands have exactly `digits` digits (0-9 when digits=1). For "/" the divisor has `digits`
    digits and the quotient too, so the division is exact and the dividend may be longer.
    Each question uses one of `formats`, a str.format template over `a`, `op`, `b`.

    `commutative_twins`: True (the original sets) treats "37+48" and "48+37" as two problems, so
    one may be in the train split and its twin in the test split (for + and *, the same answer to
    learn); False makes them one problem, so a split never holds another split's twin.
    """

    digits: int = 2
    ops: tuple[str, ...] = ("+", "-")
    negative_results: bool = False  # False: "a - b" is drawn with a >= b
    formats: tuple[str, ...] = ("What is {a} {op} {b}?",)
    commutative_twins: bool = True

    def __post_init__(self):
        super().__post_init__()
        self.require([(1 <= self.digits <= 9, "digits must be in 1..9"),
                      (bool(self.ops) and not set(self.ops) - set(OPS), f"ops must be a non-empty subset of {OPS}"),
                      (bool(self.formats), "formats must not be empty")])
        for fmt in self.formats:
            names = {f for _, f, _, _ in string.Formatter().parse(fmt) if f is not None}
            if names != {"a", "op", "b"}:
                raise ValueError(
                    f"config {self.name!r}: format {fmt!r} must use exactly the fields "
                    f"{{a}}, {{op}} and {{b}}, it uses {sorted(names)}"
                )


def _operand(rng: StableRandom, digits: int, *, nonzero: bool = False) -> int:
    low = 10 ** (digits - 1) if digits > 1 else int(nonzero)
    return rng.randint(low, 10**digits - 1)


def draw_problem(config: ArithmeticConfig, rng: StableRandom) -> tuple[int, str, int, int]:
    """(a, op, b, a op b) with an integer result."""
    op = rng.choice(config.ops)
    if op == "/":
        b = _operand(rng, config.digits, nonzero=True)
        quotient = _operand(rng, config.digits)
        return b * quotient, op, b, quotient
    a, b = _operand(rng, config.digits), _operand(rng, config.digits)
    if op == "-" and not config.negative_results and a < b:
        a, b = b, a
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return a, op, b, result


class Arithmetic(SyntheticBuilder, skip_registration=True):
    """Integer arithmetic questions; `answer` is the result as a decimal string."""

    name = "arithmetic"
    DESCRIPTION = "Seeded synthetic integer arithmetic: one binary operation per question."
    BUILDER_CONFIGS = [
        ArithmeticConfig(
            name="small",
            description="2-digit + and -, two wordings; sized for a tiny char-level model.",
            digits=2,
            ops=("+", "-"),
            formats=("What is {a} {op} {b}?", "{a}{op}{b}="),
            num_train=5000,
            num_test=500,
        ),
        ArithmeticConfig(
            name="tiny",
            description="1-digit + - *; 300 distinct problems in all.",
            digits=1,
            ops=("+", "-", "*"),
            formats=("What is {a} {op} {b}?",),
            num_train=200,
            num_test=50,
        ),
        ArithmeticConfig(
            name="medium",
            description="3-digit + - * /.",
            digits=3,
            ops=OPS,
            formats=("What is {a} {op} {b}?", "{a}{op}{b}="),
            num_train=20000,
            num_test=1000,
        ),
    ]
    DEFAULT_BUILDER_CONFIG_NAME = "small"

    def _features(self):
        return {"question": tfds.features.Text(), "answer": tfds.features.Text()}

    def _draw(self, rng: StableRandom) -> tuple[Any, dict[str, Any]]:
        a, op, b, result = draw_problem(self.builder_config, rng)
        question = rng.choice(self.builder_config.formats).format(a=a, op=op, b=b)
        # The key ignores the wording: "What is 3 + 4?" and "3+4=" are one problem, so they
        # never land in different splits; without commutative twins, nor do "3+4" and "4+3".
        key = (min(a, b), op, max(a, b)) if op in "+*" and not self.builder_config.commutative_twins else (a, op, b)
        return key, {"question": question, "answer": str(result)}
