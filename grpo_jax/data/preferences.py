"""`arithmetic_preferences`: preference pairs (chosen, rejected) for training a reward model offline.

Each row is an arithmetic question with two answers: `chosen` is the right result, written
plainly; `rejected` is a wrong result (`kind: wrong`, off by 1 to `max_offset`; `kind: digit`, one
digit of the result, at any position, one up or down: off by 1, 10 or 100, so a wrong tens digit
is as common as a wrong last one) or the right one buried in filler (`kind: verbose`). A reward model trained on it
(`grpo-jax train-rm`) learns to prefer answers that are correct and concise: the preference a
verifier-free GRPO run then optimises. Rejections that are all near misses of one kind teach a
reward model only that kind: a policy trained on it then finds the wrong answers it never saw
(README, "Spotting a policy that games the reward model"). Questions use the `arithmetic`
builder's problems and formats, so the policy demo's prompts are in its domain.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow_datasets as tfds

from grpo_jax.data._rng import StableRandom
from grpo_jax.data.arithmetic import ArithmeticConfig, draw_problem
from grpo_jax.data.synthetic import SyntheticBuilder

KINDS = ("wrong", "digit", "verbose")
FILLERS = ("{r}, I think", "maybe {r}", "{r} or so", "it is {r}!!", "{r}, probably")


@dataclasses.dataclass(eq=False)
class PreferencesConfig(ArithmeticConfig):
    """`ArithmeticConfig`'s problems, and which kinds of rejected answer to draw (evenly)."""

    kinds: tuple[str, ...] = ("wrong", "verbose")
    max_offset: int = 10

    def __post_init__(self):
        super().__post_init__()
        self.require([(bool(self.kinds) and not set(self.kinds) - set(KINDS), f"kinds must be a non-empty subset of {KINDS}"),
                      (self.max_offset >= 1, "max_offset must be >= 1")])


class ArithmeticPreferences(SyntheticBuilder, skip_registration=True):
    """Rows: question, chosen, rejected, answer (the right result) and kind."""

    name = "arithmetic_preferences"
    DESCRIPTION = "Seeded synthetic preference pairs: a correct, concise answer against a wrong or verbose one."
    BUILDER_CONFIGS = [
        PreferencesConfig(
            name="small",
            description="2-digit +, the demo's '{a}{op}{b}=' wording; wrong and verbose rejections.",
            digits=2, ops=("+",), formats=("{a}{op}{b}=",), num_train=6000, num_test=500,
        ),
    ]
    DEFAULT_BUILDER_CONFIG_NAME = "small"

    def _features(self):
        return {name: tfds.features.Text() for name in ("question", "chosen", "rejected", "answer", "kind")}

    def _draw(self, rng: StableRandom) -> tuple[Any, dict[str, Any]]:
        config = self.builder_config
        a, op, b, result = draw_problem(config, rng)
        question = rng.choice(config.formats).format(a=a, op=op, b=b)
        kind = rng.choice(config.kinds)
        if kind == "wrong":
            offset = rng.randint(1, config.max_offset) * rng.choice((-1, 1))
            if result + offset < 0 and not config.negative_results:
                offset = -offset
            rejected = str(result + offset)
        elif kind == "digit":
            rejected = replace_digit(str(result), rng)
        else:
            rejected = rng.choice(FILLERS).format(r=result)
        return (a, op, b), {"question": question, "chosen": str(result), "rejected": rejected,
                            "answer": str(result), "kind": kind}


def replace_digit(number: str, rng: StableRandom) -> str:
    """`number` with one of its digits (any position, chosen evenly) one up or down: the near misses
    a slipped carry makes (off by 1, 10, 100, ...); a leading digit never becomes 0."""
    at = rng.choice([i for i, c in enumerate(number) if c.isdigit()])
    lowest = 1 if not number[:at].lstrip("-") and len(number.lstrip("-")) > 1 else 0
    digit = int(number[at])
    moves = [d for d in (digit - 1, digit + 1) if lowest <= d <= 9]
    return number[:at] + str(rng.choice(moves)) + number[at + 1:]
