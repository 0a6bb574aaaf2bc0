"""`countdown`: reach a target from given numbers with + - * /; every target is reachable.

Targets are made by building a random expression over the numbers (the Countdown game's
rules: each number at most once, every intermediate result a positive integer), so a
solution always exists and one is stored as `answer`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from grpo_jax.data._rng import StableRandom
from grpo_jax.data.synthetic import SyntheticBuilder, SyntheticConfig

_MAX_TRIES = 10_000
QUESTION = "Using the numbers {numbers}, reach {target} with + - * / (each number at most once)."


@dataclasses.dataclass(eq=False)
class CountdownConfig(SyntheticConfig):
    """`num_numbers` numbers drawn from [min_number, max_number] (repeats allowed); the hidden
    solution uses at least `min_used` of them; targets lie in [min_target, max_target] and are
    never one of the given numbers (that would need no arithmetic)."""

    num_numbers: int = 3
    min_number: int = 1
    max_number: int = 20
    min_used: int = 2
    min_target: int = 1
    max_target: int = 100

    def __post_init__(self):
        super().__post_init__()
        self.require([
            (self.num_numbers >= 2, "num_numbers must be >= 2"),
            (2 <= self.min_used <= self.num_numbers, "min_used must be in 2..num_numbers"),
            (1 <= self.min_number <= self.max_number, "need 1 <= min_number <= max_number"),
            (1 <= self.min_target <= self.max_target, "need 1 <= min_target <= max_target"),
        ])


def random_expression(numbers: list[int], rng: StableRandom) -> tuple[int, str]:
    """Combine all of `numbers` pairwise at random into (value, expression text).

    Only moves that keep every intermediate a positive integer are drawn; + is always one.
    """
    # Each node: (value, text, is_leaf); non-leaf operands get parentheses.
    nodes = [(n, str(n), True) for n in numbers]
    while len(nodes) > 1:
        i, j = rng.sample(range(len(nodes)), 2)
        (a, ta, la), (b, tb, lb) = nodes[i], nodes[j]
        moves = [("+", a + b), ("*", a * b)]
        if a > b:
            moves.append(("-", a - b))
        if b > 1 and a % b == 0:
            moves.append(("/", a // b))
        op, value = rng.choice(moves)
        text = f"{ta if la else f'({ta})'} {op} {tb if lb else f'({tb})'}"
        nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [(value, text, False)]
    value, text, _ = nodes[0]
    return value, text


def draw_puzzle(config: CountdownConfig, rng: StableRandom) -> tuple[list[int], int, str]:
    """(numbers, target, one solution), retrying until the target is in range and not trivial."""
    for _ in range(_MAX_TRIES):
        numbers = [rng.randint(config.min_number, config.max_number) for _ in range(config.num_numbers)]
        used = rng.sample(numbers, rng.randint(config.min_used, config.num_numbers))
        target, solution = random_expression(used, rng)
        if config.min_target <= target <= config.max_target and target not in numbers:
            return numbers, target, solution
    raise ValueError(
        f"countdown config {config.name!r}: no puzzle with a target in "
        f"[{config.min_target}, {config.max_target}] in {_MAX_TRIES} tries; widen the target range "
        f"or change the numbers ({config.params()})"
    )


class Countdown(SyntheticBuilder, skip_registration=True):
    """Countdown puzzles: `numbers`, `target`, and one valid expression as `answer`."""

    name = "countdown"
    DESCRIPTION = "Seeded synthetic Countdown puzzles with guaranteed-reachable targets."
    BUILDER_CONFIGS = [
        CountdownConfig(
            name="small",
            description="3 numbers in 1..20, targets 1..100.",
            num_train=5000,
            num_test=500,
        ),
        CountdownConfig(
            name="standard",
            description="4 numbers in 1..100 (solutions use 3-4), targets 1..1000.",
            num_numbers=4,
            max_number=100,
            min_used=3,
            max_target=1000,
            num_train=20000,
            num_test=1000,
        ),
    ]
    DEFAULT_BUILDER_CONFIG_NAME = "small"

    def _features(self):
        return {
            "question": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "numbers": tfds.features.Sequence(tfds.features.Scalar(np.int64)),
            "target": tfds.features.Scalar(np.int64),
        }

    def _draw(self, rng: StableRandom) -> tuple[Any, dict[str, Any]]:
        numbers, target, solution = draw_puzzle(self.builder_config, rng)
        question = QUESTION.format(numbers=numbers, target=target)
        # Same multiset and target = same puzzle, whatever the order the numbers are listed in.
        key = (tuple(sorted(numbers)), target)
        return key, {"question": question, "answer": solution, "numbers": numbers, "target": target}
