"""What every run-health check shares: the two levels (a failure, a notice), the `Flag` a check
raises, and the helpers that read a run's metrics (`windows`: an early and a late window of
steps; `train_records`; `best_checkpoint`, the knob that points at the best evaluation's step).
The checks: grpo_jax.observe.health_checks (training dynamics, and `diagnose` over all) and
grpo_jax.observe.heldout_checks (held-out accuracy, judges, over-optimisation, retention).
"""

from __future__ import annotations

import dataclasses

import numpy as np

MIN_STEPS = 8  # fewer logged train steps than this: too short to judge trends (said on the page)
REWARD_RISE = 0.05  # training reward up by at least this much (late window vs early window)
ACCURACY_FALL = 0.05  # a held-out score below its best by at least this much (with reward rising)

FAILURE, NOTICE = "failure", "notice"


@dataclasses.dataclass(frozen=True)
class Flag:
    key: str  # a stable identifier, e.g. "entropy_collapse"
    title: str
    evidence: str  # the numbers that raised it
    knobs: tuple[tuple[str, str], ...]  # (config key or setting, how it helps) for what addresses it
    level: str = FAILURE  # FAILURE, or NOTICE: a trend to watch


def windows(values: np.ndarray) -> tuple[float, float] | None:
    """(mean of the first quarter, mean of the last quarter), each at least 3 values; None if too few."""
    if values.size < 2 * 3:
        return None
    w = max(3, values.size // 4)
    return float(values[:w].mean()), float(values[-w:].mean())


def train_records(records):
    return [r for r in records if r["step"] > 0 and "reward/mean" in r]


def best_checkpoint(step: int) -> tuple[str, str]:
    if step == 0:
        return ("train.steps", "the policy before any update had the best held-out accuracy")
    return (f"checkpoints/{step}", "the best held-out accuracy, if that step was saved (checkpoint.every)")
