"""The contract of a reward that holds something: a model on the devices, statistics across steps.

A registry entry that is a class (`reward_model`, `llm_judge`) is built once from its kwargs when
the config is read, and must be a `StatefulReward`, checked there. The run then places it on its
mesh (`place`), saves its `state()` with every checkpoint and restores it (`load_state`) on
resume, and evaluates held-out samples through `without_updates()`, which scores without learning
from what it scores (a reward model's running normalisation stays as training left it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from grpo_jax.rewards.combine import RewardFn


@runtime_checkable
class StatefulReward(Protocol):
    def __call__(self, prompts, completions, **fields) -> list[float | None]: ...

    def place(self, mesh) -> None:
        """Put the reward's arrays on `mesh` (the run's, by the policy's sharding rules)."""

    def state(self) -> dict:
        """What a checkpoint keeps of it (JSON)."""

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Back to what `state()` returned."""

    def without_updates(self) -> RewardFn:
        """The same scores, without updating what the reward keeps (for evaluation)."""
