"""The loop's hooks, levanter-style: periodic work after a step (evaluation, metrics, samples,
the progress bar, checkpoints, the reward watch) is a `Hook` with an `every=` that reads one
`StepInfo`, so a new periodic job is one more hook, not an edit of the loop (grpo_jax.trainer.loop)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

MetricHook = Callable[[int, dict], None]  # a caller's `train(hooks=...)`: (step, metrics)


@dataclasses.dataclass
class StepInfo:
    """What every hook reads after the update of a step."""

    step: int
    state: Any  # the train state after the update (placed)
    batch: Any  # what the update learned from: the RL loop's Trajectories (grpo_jax.rollout.source)
    metrics: dict  # the step's metrics: a hook may add to them for the hooks after it (evaluation's)
    last: bool  # the run's last step


@dataclasses.dataclass(frozen=True)
class Hook:
    """Periodic work after a step: `fn(info)` every `every` steps (0: never by count) and, with
    `at_last`, at the run's last step; True from `fn` stops the run after this step. A new
    periodic job is one more Hook, not an edit of the loop."""

    fn: Callable[[StepInfo], bool | None]
    every: int = 1
    at_last: bool = False

    def due(self, info: StepInfo) -> bool:
        return bool(self.every and info.step % self.every == 0) or (self.at_last and info.last)
