"""DAPO's soft overlong punishment as a reward function, in tokens.

The trainer passes every reward function the token count of each completion as the example field
`completion_tokens`; this function turns it into a penalty in [-1, 0] (`grpo.overlong_penalty`):
0 up to `max_length - cache_length` tokens, falling linearly to -1 at `max_length`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from grpo_jax.learner.grpo import overlong_penalty


def overlong_reward(prompts: Sequence[str], completions: Sequence[str], *, completion_tokens: Sequence[int],
                    max_length: int, cache_length: int, **_: object) -> list[float]:
    if len(completion_tokens) != len(completions):
        raise ValueError(f"{len(completion_tokens)} token counts for {len(completions)} completions")
    lengths = np.asarray(completion_tokens, np.int32)
    return [float(v) for v in np.asarray(overlong_penalty(lengths, max_length, cache_length))]
