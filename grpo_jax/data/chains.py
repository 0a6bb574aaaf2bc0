"""`arithmetic_chain`: a left-to-right chain of one-digit operations ("7+5-3+8+6-9=") whose answer is
written as its derivation, every running total in turn ("12 9 17 23 14"); the reward reads the
last number. The final total depends on every step, the first above all: a slip early makes the
rest of a long, locally consistent derivation worthless. That is the credit a value function can
assign token by token and a group's mean reward cannot (issue 46's critic task).

Rows: `question`, `answer` (the final total), `derivation` (the running totals, space-separated:
the warm start's reference completion with `sft.answer_template: "{derivation}"`) and `steps`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from grpo_jax.data._rng import StableRandom
from grpo_jax.data.synthetic import SyntheticBuilder, SyntheticConfig


@dataclasses.dataclass(eq=False)
class ChainConfig(SyntheticConfig):
    """A start in 1..9 and `steps` operations of `ops` by 1..9; every running total stays in
    0..`max_total` (a draw that would leave it takes the other operation)."""

    steps: int = 4
    ops: tuple[str, ...] = ("+", "-")
    max_total: int = 99

    def __post_init__(self):
        super().__post_init__()
        self.require([(1 <= self.steps <= 32, "steps must be in 1..32"),
                      (bool(self.ops) and not set(self.ops) - {"+", "-"}, "ops must be a non-empty subset of ('+', '-')"),
                      (self.max_total >= 18, "max_total must be >= 18")])


def draw_chain(config: ChainConfig, rng: StableRandom) -> tuple[int, list[tuple[str, int]], list[int]]:
    """(start, [(op, operand)], running totals) of one chain."""
    total = start = rng.randint(1, 9)
    moves, totals = [], []
    for _ in range(config.steps):
        op, n = rng.choice(config.ops), rng.randint(1, 9)
        if op == "-" and total - n < 0 or op == "+" and total + n > config.max_total:
            op = "+" if op == "-" else "-"
        total = total + n if op == "+" else total - n
        moves.append((op, n))
        totals.append(total)
    return start, moves, totals


class ArithmeticChain(SyntheticBuilder, skip_registration=True):
    """Chains of one-digit additions and subtractions answered by their running totals."""

    name = "arithmetic_chain"
    DESCRIPTION = "Seeded chains of one-digit + and -, answered step by step; the reward reads the last total."
    BUILDER_CONFIGS = [
        ChainConfig(name="short", description="4 operations (answers of 7-11 characters)", steps=4,
                    num_train=5000, num_test=500),
        ChainConfig(name="long", description="8 operations (answers of 15-23 characters)", steps=8,
                    num_train=5000, num_test=500),
    ]
    DEFAULT_BUILDER_CONFIG_NAME = "short"

    def _features(self):
        return {"question": tfds.features.Text(), "answer": tfds.features.Text(),
                "derivation": tfds.features.Text(), "steps": tfds.features.Scalar(np.int64)}

    def _draw(self, rng: StableRandom) -> tuple[Any, dict[str, Any]]:
        start, moves, totals = draw_chain(self.builder_config, rng)
        question = str(start) + "".join(f"{op}{n}" for op, n in moves) + "="
        return question, {"question": question, "answer": str(totals[-1]), "steps": len(moves),
                          "derivation": " ".join(map(str, totals))}
