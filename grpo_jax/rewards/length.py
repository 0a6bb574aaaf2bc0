"""DAPO's soft overlong punishment as a reward function, in tokens.

The trainer passes every reward function the token count of each completion as the example field
`completion_tokens`; this function turns it into a penalty in [-1, 0] (`grpo.overlong_penalty`):
0 up to `max_length - cache_length` tokens, falling linearly to -1 at `max_length`. A count that
is not a non-negative integer (None, a string, a bool, a float, a negative number) cannot be
judged: that sample is None, the others are scored as usual.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from grpo_jax.groups import overlong_penalty


def overlong_reward(prompts: Sequence[str], completions: Sequence[str], *, completion_tokens: Sequence[int],
                    max_length: int, cache_length: int, **_: object) -> list[float | None]:
    if len(completion_tokens) != len(completions):
        raise ValueError(f"{len(completion_tokens)} token counts for {len(completions)} completions")
    counts = [_count(n) for n in completion_tokens]
    # Beyond max_length the penalty is -1 whatever the count: clip so any int fits in int32.
    lengths = np.asarray([min(n, max_length + 1) for n in counts if n is not None], np.int32)
    penalties = iter(np.asarray(overlong_penalty(lengths, max_length, cache_length)).tolist())
    return [None if n is None else float(next(penalties)) for n in counts]


def _count(value: object) -> int | None:
    """A token count as an int, or None when it is not a non-negative integer."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) and value >= 0:
        return int(value)
    return None
