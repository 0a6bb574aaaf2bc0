"""The seam between the actor and the learner is real: the loop runs against a fake rollout source
and a fake learner, with no model, and follows the protocol (pull trajectories, update, hand the
new parameters back, then the hooks in order)."""

from __future__ import annotations

import dataclasses

import numpy as np

from grpo_jax.rollout.source import RolloutSource, Trajectories
from grpo_jax.trainer.loop import run_steps


@dataclasses.dataclass
class FakeSource:
    """Trajectories whose rewards say which parameters sampled them."""

    params: float = 0.0
    log: list = dataclasses.field(default_factory=list)

    def next(self, step: int) -> Trajectories:
        self.log.append(("next", step, self.params))
        rewards = np.full(4, self.params, np.float32)
        return Trajectories(prompt_ids=None, prompt_mask=None, completion_ids=None, completion_mask=None,
                            rewards=rewards, truncated=None, old_logprobs=None, group_size=2, tokens=8,
                            metrics={"reward/mean": float(rewards.mean())}, first=None, pass_rates=np.zeros(2))

    def sync(self, params) -> None:
        self.log.append(("sync", params))
        self.params = params


class FakeLearner:
    """state -> state + mean reward; its params are the state itself."""

    def update(self, state, trajectories, while_waiting=None):
        if while_waiting is not None:  # a pipelined source samples ahead while the update runs
            while_waiting()
        return state + float(trajectories.rewards.mean()) + 1.0, {"train/loss": -state}

    def params(self, state):
        return state


def test_the_loop_runs_a_fake_source_and_learner_in_protocol_order():
    source, seen = FakeSource(), []
    assert isinstance(source, RolloutSource)

    def hook(step, state, trajectories, metrics):
        seen.append((step, state, dict(metrics)))
        metrics["hooked"] = 1.0  # a later hook sees what an earlier one added

    def later(step, state, trajectories, metrics):
        assert metrics["hooked"] == 1.0

    state, stopped = run_steps(source, FakeLearner(), 0.0, range(1, 4), [hook, later])
    # Each step samples with the parameters the previous update produced: 0 -> 1 -> 3 -> 7.
    assert [entry for entry in source.log if entry[0] == "next"] == [("next", 1, 0.0), ("next", 2, 1.0),
                                                                      ("next", 3, 3.0)]
    assert [entry for entry in source.log if entry[0] == "sync"] == [("sync", 1.0), ("sync", 3.0), ("sync", 7.0)]
    assert state == 7.0 and stopped is None
    assert [(s, st) for s, st, _ in seen] == [(1, 1.0), (2, 3.0), (3, 7.0)]
    # The step's metrics hold the learner's and the source's, and the step's time.
    assert seen[1][2]["train/loss"] == -1.0 and seen[1][2]["reward/mean"] == 1.0 and seen[1][2]["perf/step_s"] >= 0


def test_a_hook_that_asks_to_stop_ends_the_loop_after_that_step():
    source = FakeSource()
    state, stopped = run_steps(source, FakeLearner(), 0.0, range(1, 10), [lambda step, *_: step == 2])
    assert stopped == 2 and state == 3.0
    assert [e[1] for e in source.log if e[0] == "next"] == [1, 2]
    # A stop asked at the last step is the normal end, not an early stop.
    _, stopped = run_steps(FakeSource(), FakeLearner(), 0.0, range(1, 3), [lambda step, *_: step == 2])
    assert stopped is None
