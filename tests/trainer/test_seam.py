"""The seam between the actor and the learner is real: the loop runs against a fake rollout source
and a fake learner, with no model, and follows the protocol (pull trajectories, update, hand the
new parameters back, then the hooks in order)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from grpo_jax.rollout.source import RolloutSource, SampleLog, TrainRows, Trajectories
from grpo_jax.trainer.hooks import Hook
from grpo_jax.trainer.loop import run_steps


@dataclasses.dataclass
class FakeSource(RolloutSource):
    """Trajectories whose rewards say which parameters sampled them."""

    params: float = 0.0
    log: list = dataclasses.field(default_factory=list)

    def next(self, step: int) -> Trajectories:
        self.log.append(("next", step, self.params))
        rewards = np.full(4, self.params, np.float32)
        rows = TrainRows(prompt_ids=None, prompt_mask=None, completion_ids=None, completion_mask=None,
                         rewards=rewards, truncated=None, old_logprobs=None)
        return Trajectories(rows=rows, group_size=2, tokens=8, metrics={"reward/mean": float(rewards.mean())},
                            log=SampleLog(first=None, pass_rates=np.zeros(2)))

    def sync(self, params) -> None:
        self.log.append(("sync", params))
        self.params = params


class FakeLearner:
    """state -> state + mean reward; its params are the state itself."""

    def update(self, state, trajectories, while_waiting=None):
        if while_waiting is not None:  # a pipelined source samples ahead while the update runs
            while_waiting()
        return state + float(trajectories.rows.rewards.mean()) + 1.0, {"train/loss": -state}

    def params(self, state):
        return state


def test_the_loop_runs_a_fake_source_and_learner_in_protocol_order():
    source, seen = FakeSource(), []
    assert isinstance(source, RolloutSource)

    def hook(info):
        seen.append((info.step, info.state, dict(info.metrics)))
        info.metrics["hooked"] = 1.0  # a later hook sees what an earlier one added

    def later(info):
        assert info.metrics["hooked"] == 1.0

    state, stopped = run_steps(source, FakeLearner(), 0.0, range(1, 4), [Hook(hook), Hook(later)])
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
    state, stopped = run_steps(source, FakeLearner(), 0.0, range(1, 10), [Hook(lambda i: i.step == 2)])
    assert stopped == 2 and state == 3.0
    assert [e[1] for e in source.log if e[0] == "next"] == [1, 2]
    # A stop asked at the last step is the normal end, not an early stop.
    _, stopped = run_steps(FakeSource(), FakeLearner(), 0.0, range(1, 3), [Hook(lambda i: i.step == 2)])
    assert stopped is None


def test_a_source_missing_a_declared_method_fails_when_built_not_in_a_run():
    class Forgetful(RolloutSource):  # no sync: the loop would call it after the first update
        def next(self, step):
            raise AssertionError("never reached")

    with pytest.raises(TypeError, match="abstract method.*sync"):
        Forgetful()
    # What most sources have nothing to do for is declared with a default: nothing ahead or in flight.
    source = FakeSource()
    assert source.ahead() is None and source.in_flight() is None
    with pytest.raises(ValueError, match="no batches in flight"):
        source.in_flight_like(1)


def test_hooks_run_when_due_every_n_steps_and_at_the_last():
    calls = []
    hooks = [Hook(lambda i: calls.append(("every2", i.step)), every=2),
             Hook(lambda i: calls.append(("last", i.step)), every=0, at_last=True),
             Hook(lambda i: calls.append(("3+last", i.step)), every=3, at_last=True)]
    run_steps(FakeSource(), FakeLearner(), 0.0, range(1, 6), hooks)
    assert calls == [("every2", 2), ("3+last", 3), ("every2", 4), ("last", 5), ("3+last", 5)]
