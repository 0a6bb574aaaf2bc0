"""The contract of a reward that holds something: a model on the devices, statistics across steps.

A registry entry that is a class (`reward_model`, `llm_judge`) is built once from its kwargs when
the config is read, and must be a `StatefulReward`, checked there. The run then places it on its
mesh (`place`), saves its `state_dict()` with every checkpoint and restores it (`load_state_dict`) on
resume, and evaluates held-out samples through `without_updates()`, which scores without learning
from what it scores (a reward model's running normalisation stays as training left it). A user's
class (`module:Class`) is wrapped in `TimedReward`: each call within its `timeout_s`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from grpo_jax.rewards.combine import RewardFn
from grpo_jax.usercode import start_local


@runtime_checkable
class StatefulReward(Protocol):
    def __call__(self, prompts, completions, **fields) -> list[float | None]: ...

    def place(self, mesh) -> None:
        """Put the reward's arrays on `mesh` (the run's, by the policy's sharding rules)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of it (JSON)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Back to what `state_dict()` returned."""

    def without_updates(self) -> RewardFn:
        """The same scores, without updating what the reward keeps (for evaluation)."""


class TimedReward:
    """A user's StatefulReward (`module:Class`) with a time limit on each call: it holds the run's
    devices, so it cannot run in a worker process; its calls run on the trainer's bounded threads
    (grpo_jax.usercode.calls) and give up after `timeout_s` (CallTimeout, its samples dropped) or
    when the run is stopping. The rest of the protocol goes to the reward itself."""

    def __init__(self, reward: StatefulReward, timeout_s: float):
        self.reward, self.timeout_s = reward, float(timeout_s)

    def __call__(self, prompts, completions, **fields) -> list[float | None]:
        return start_local(functools.partial(self.reward, prompts, completions, **fields)).result(self.timeout_s)

    def place(self, mesh) -> None:
        self.reward.place(mesh)

    def state_dict(self) -> dict:
        return self.reward.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reward.load_state_dict(state)

    def without_updates(self) -> RewardFn:
        fn = self.reward.without_updates()
        return lambda prompts, completions, **fields: start_local(
            functools.partial(fn, prompts, completions, **fields)).result(self.timeout_s)


class RewardStates:
    """The rewards that keep state, as one checkpoint component (grpo_jax.trainer.run_state):
    `{reward name: its state_dict()}`; loading gives each reward its saved state by name."""

    def __init__(self, rewards: Sequence):
        self.held = {s.name: s.fn for s in rewards if isinstance(s.fn, StatefulReward)}

    def state_dict(self) -> dict:
        return {name: fn.state_dict() for name, fn in self.held.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, saved in state.items():
            if name in self.held:
                self.held[name].load_state_dict(saved)
