"""`word_problems`: GSM8K-style arithmetic word problems with an integer answer, generated from a seed.

GSM8K itself needs its four jsonl files (or a network); these problems need nothing, so a real
model can be trained and evaluated on them offline. Each problem is one of a fixed set of
story templates with one, two or three operations over small numbers; every intermediate result
is a non-negative integer and divisions are exact. `answer` is the result; `solution` is a
GSM8K-style worked answer ending in `#### <result>` (for a supervised warm start); `expression` is
the whole computation as one arithmetic expression (for a warm start that calls a calculator).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow_datasets as tfds

from grpo_jax.data._rng import StableRandom
from grpo_jax.data.synthetic import SyntheticBuilder, SyntheticConfig

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hana", "Ivan", "Julia", "Kofi", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq")
ITEMS = ("apples", "marbles", "stickers", "cookies", "pencils", "stamps", "shells", "books", "cards", "eggs")


class Template(NamedTuple):
    """A story with `{name}`, `{item}` and number fields; `solve` maps the numbers to the worked
    steps [(expression text, value)] or None when they break the story (negative, inexact)."""

    steps: int
    text: str
    numbers: tuple[str, ...]  # the number fields, in the order `solve` takes them
    factors: tuple[str, ...]  # the fields the story multiplies or divides by (kept small)
    solve: Callable[..., list[tuple[str, int]] | None]


def _sub(a: int, b: int) -> int | None:
    return a - b if a >= b else None


def _div(a: int, b: int) -> int | None:
    return a // b if b > 0 and a % b == 0 else None


def _chain(*pairs: tuple[str, int | None]) -> list[tuple[str, int]] | None:
    return None if any(v is None for _, v in pairs) else list(pairs)  # type: ignore[arg-type]


TEMPLATES: tuple[Template, ...] = (
    Template(1, "{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?",
             ("a", "b"), (), lambda a, b: _chain((f"{a} + {b}", a + b))),
    Template(1, "{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?",
             ("a", "b"), (), lambda a, b: _chain((f"{a} - {b}", _sub(a, b)))),
    Template(1, "{name} buys {a} bags of {item}. Each bag holds {b} {item}. How many {item} did {name} buy?",
             ("a", "b"), ("b",), lambda a, b: _chain((f"{a} * {b}", a * b))),
    Template(1, "{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
             ("a", "b"), ("b",), lambda a, b: _chain((f"{a} / {b}", _div(a, b)))),
    Template(2, "{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each. "
                "How many {item} does {name} have now?",
             ("a", "b", "c"), ("c",), lambda a, b, c: _chain((f"{b} * {c}", b * c), (f"{a} + {b * c}", a + b * c))),
    Template(2, "A shop had {a} {item}. It sold {b} in the morning and {c} in the afternoon. "
                "How many {item} are left?",
             ("a", "b", "c"), (), lambda a, b, c: _chain((f"{b} + {c}", b + c), (f"{a} - {b + c}", _sub(a, b + c)))),
    Template(2, "{name} earns {a} dollars an hour and works {b} hours, then spends {c} dollars. "
                "How many dollars does {name} have left?",
             ("a", "b", "c"), ("b",), lambda a, b, c: _chain((f"{a} * {b}", a * b), (f"{a * b} - {c}", _sub(a * b, c)))),
    Template(2, "{name} reads {a} pages a day for {b} days and then {c} more pages. "
                "How many pages does {name} read in all?",
             ("a", "b", "c"), ("b",), lambda a, b, c: _chain((f"{a} * {b}", a * b), (f"{a * b} + {c}", a * b + c))),
    Template(2, "{name} has {a} {item} and gets {b} more, then puts them into {c} equal boxes. "
                "How many {item} go in each box?",
             ("a", "b", "c"), ("c",), lambda a, b, c: _chain((f"{a} + {b}", a + b), (f"{a + b} / {c}", _div(a + b, c)))),
    Template(3, "{name} buys {a} boxes of {item} with {b} in each box and {c} loose {item}, "
                "then gives away {d}. How many {item} does {name} keep?",
             ("a", "b", "c", "d"), ("b",),
             lambda a, b, c, d: _chain((f"{a} * {b}", a * b), (f"{a * b} + {c}", a * b + c),
                                       (f"{a * b + c} - {d}", _sub(a * b + c, d)))),
    Template(3, "{name} saves {a} dollars a week for {b} weeks, spends {c} dollars and splits the rest "
                "equally with a sibling. How many dollars does {name} keep?",
             ("a", "b", "c"), ("b",),
             lambda a, b, c: _chain((f"{a} * {b}", a * b), (f"{a * b} - {c}", _sub(a * b, c)),
                                    (f"{a * b - c} / 2", _div(a * b - c, 2) if a * b >= c else None))),
)


@dataclasses.dataclass(eq=False)
class WordProblemsConfig(SyntheticConfig):
    """Problems with `min_steps`..`max_steps` operations; numbers in [1, max_number], multipliers
    and divisors (the numbers a story multiplies or divides by) in [2, max_factor]."""

    min_steps: int = 1
    max_steps: int = 2
    max_number: int = 50
    max_factor: int = 9

    def __post_init__(self):
        super().__post_init__()
        self.require([(1 <= self.min_steps <= self.max_steps <= 3, "need 1 <= min_steps <= max_steps <= 3"),
                      (self.max_number >= 2 and self.max_factor >= 2, "max_number and max_factor must be >= 2")])


_MAX_TRIES = 1000


def draw_problem(config: WordProblemsConfig, rng: StableRandom) -> tuple[int, dict[str, int], list[tuple[str, int]]]:
    """(template index, its numbers, worked steps), redrawn until the story holds (no negative
    amount, exact divisions)."""
    choices = [i for i, t in enumerate(TEMPLATES) if config.min_steps <= t.steps <= config.max_steps]
    for _ in range(_MAX_TRIES):
        index = rng.choice(choices)
        template = TEMPLATES[index]
        numbers = {k: rng.randint(2, config.max_factor) if k in template.factors else rng.randint(1, config.max_number)
                   for k in template.numbers}
        steps = template.solve(*(numbers[k] for k in template.numbers))
        if steps is not None:
            return index, numbers, steps
    raise ValueError(f"word_problems config {config.name!r}: no valid problem in {_MAX_TRIES} draws ({config.params()})")


def expression_text(steps: list[tuple[str, int]]) -> str:
    """The whole computation as one arithmetic expression: in each step, the earlier result becomes
    the expression that computed it, in parentheses ("(3 * 4) + 5")."""
    expression, value = steps[0]
    for text, result in steps[1:]:
        earlier = f"({expression})"
        expression = re.sub(rf"(?<!\d){value}(?!\d)", lambda _: earlier, text, count=1)
        value = result
    return expression


def solution_text(steps: list[tuple[str, int]]) -> str:
    """GSM8K's answer style: one line per step, then `#### result`."""
    lines = [f"{expr} = {value}" for expr, value in steps]
    return "\n".join(lines + [f"#### {steps[-1][1]}"])


class WordProblems(SyntheticBuilder, skip_registration=True):
    """Arithmetic word problems; `answer` is the integer result as a decimal string."""

    name = "word_problems"
    DESCRIPTION = "Seeded synthetic GSM8K-style word problems: 1-3 operations over small integers."
    BUILDER_CONFIGS = [
        WordProblemsConfig(name="one_step", description="One operation, numbers up to 40 (SmolLM2-135M-Instruct: 8% at T=0.6).",
                           min_steps=1, max_steps=1, max_number=40, max_factor=9, num_train=2000, num_test=300),
        WordProblemsConfig(name="easy", description="1-2 operations, numbers up to 50.",
                           min_steps=1, max_steps=2, max_number=50, max_factor=9, num_train=20000, num_test=500),
        WordProblemsConfig(name="hard", description="2-3 operations, numbers up to 100.",
                           min_steps=2, max_steps=3, max_number=100, max_factor=12, num_train=20000, num_test=500),
    ]
    DEFAULT_BUILDER_CONFIG_NAME = "easy"

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {"1.0.0": "Initial release.",
                     "1.1.0": "`expression`: the computation as one expression (for tool-use warm starts)."}

    def _features(self):
        return {"question": tfds.features.Text(), "answer": tfds.features.Text(), "solution": tfds.features.Text(),
                "expression": tfds.features.Text()}

    def _draw(self, rng: StableRandom) -> tuple[Any, dict[str, Any]]:
        index, numbers, steps = draw_problem(self.builder_config, rng)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        question = TEMPLATES[index].text.format(name=name, item=item, **numbers)
        # The key ignores the name and item: the same numbers in the same story are one problem.
        key = (index, *sorted(numbers.items()))
        return key, {"question": question, "answer": str(steps[-1][1]), "solution": solution_text(steps),
                     "expression": expression_text(steps)}
