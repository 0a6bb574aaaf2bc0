"""What a learner is fed from. The loop (grpo_jax.trainer.loop.run_steps) pulls each step's batch
from a `StepSource`, hands it to the learner's update, and gives the source the parameters the
update produced. The RL trainer's sources are `RolloutSource`s (grpo_jax.rollout.source: sampled
groups, scored); the reward-model trainer's is its stream of preference pairs
(grpo_jax.trainer.reward_run). Every method the loop calls is declared here, and what a checkpoint
keeps of a source (`components`: `Stateful` objects, walked by grpo_jax.trainer.run_state)."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """A component whose state a checkpoint keeps (JSON): a prompt stream, a pair stream, rewards."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class StepSource(abc.ABC):
    """A source of one batch per step. `next` and `sync` are each source's own; `ahead` defaults to
    a source that works only when asked."""

    @abc.abstractmethod
    def next(self, step: int) -> Any:
        """The batch the update of `step` learns from; its `metrics` (a dict of floats: what the
        source measured of it) join the step's metrics."""

    @abc.abstractmethod
    def sync(self, params) -> None:
        """The learner's parameters after an update (what a sampler samples with next)."""

    def ahead(self) -> None:
        """Called while the learner's update runs: a pipelined source prepares a later batch here."""

    def components(self) -> dict[str, Stateful]:
        """What a checkpoint keeps of this source, by name (the prompt stream as `data`, the rewards
        that keep state as `rewards`, a pair stream as `pairs`)."""
        return {}
