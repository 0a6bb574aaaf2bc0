"""A user reward named in the config runs in worker processes under `timeout_s`
(grpo_jax.usercode.UserFunction): one that hangs on one sample costs that sample (its batch-mates
are scored on the retry, side by side), one that hangs on all costs about two time limits, never
one per sample; a stop signal ends the wait at once, with no retry."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from grpo_jax.config import ConfigError
from grpo_jax.rewards.combine import RewardSpec, combine_rewards
from grpo_jax.rewards.registry import build_spec
from grpo_jax.rewards.stateful import StatefulReward, TimedReward
from grpo_jax.trainer.preemption import StopSignals
from grpo_jax.usercode import UserFunction

REWARDS = '''
import time

def length(prompts, completions, *, bonus=0.0, **fields):
    """Hangs on a completion "hang"; else the length plus `bonus`."""
    if "hang" in completions:
        time.sleep(3600)
    return [bonus + len(c) for c in completions]

def stuck(prompts, completions, **fields):
    time.sleep(3600)

class Counting:
    """A StatefulReward: it counts what it scored; "slow" takes it 2 s."""
    def __init__(self):
        self.scored = 0
    def __call__(self, prompts, completions, **fields):
        self.scored += len(completions)
        return self.without_updates()(prompts, completions)
    def place(self, mesh):
        pass
    def state_dict(self):
        return {"scored": self.scored}
    def load_state_dict(self, state):
        self.scored = state["scored"]
    def without_updates(self):
        def score(prompts, completions, **fields):
            if "slow" in completions:
                time.sleep(2.0)
            return [float(len(c)) for c in completions]
        return score
'''


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_a_reward_that_hangs_on_one_sample_costs_that_sample_alone(rewards_file):
    spec = build_spec(f"{rewards_file}:length", {"bonus": 1.0}, 1.0, ("rewards[0].name", "rewards[0].kwargs"),
                      timeout_s=0.5)
    assert isinstance(spec.fn, UserFunction)  # checked here, run in worker processes
    start = time.monotonic()
    result = combine_rewards([spec], ["q"] * 4, ["ab", "hang", "abc", ""])
    assert time.monotonic() - start < 3.0  # the batch's limit, then the retries side by side: not 4 limits
    np.testing.assert_array_equal(result.total, [3.0, np.nan, 4.0, 1.0])
    assert result.failures == {spec.name: 1} and result.messages[spec.name] == \
        "CallTimeout: took longer than 0.5 s (sample 1)"
    with pytest.raises(ConfigError, match="'bonsu' is not an option"):  # the signature is still checked first
        build_spec(f"{rewards_file}:length", {"bonsu": 1.0}, 1.0, ("r", "rewards[0].kwargs"))


def test_a_stop_signal_ends_the_wait_on_a_slow_reward_without_retries(rewards_file):
    spec = RewardSpec("stuck", UserFunction(f"{rewards_file}:stuck", timeout_s=60.0))
    lines = []
    with StopSignals(lines.append, stage="steps"):
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        result = combine_rewards([spec], ["q"] * 8, ["a"] * 8)
        assert time.monotonic() - start < 5.0
    assert np.isnan(result.total).all() and result.failures == {"stuck": 8}
    assert result.messages["stuck"] == "CallStopped: given up: the run received SIGTERM"
    assert spec.fn.workers.started == 1  # no retry on each sample


def test_a_users_stateful_reward_gets_its_time_limit_in_the_trainers_process(rewards_file):
    """A user's StatefulReward holds the run's devices, so it stays in the trainer's process; its
    calls still give up at `timeout_s` (on the trainer's bounded threads)."""
    spec = build_spec(f"{rewards_file}:Counting", {}, 1.0, ("r", "k"), timeout_s=0.5)
    assert isinstance(spec.fn, TimedReward) and isinstance(spec.fn, StatefulReward)
    result = combine_rewards([spec], ["q"] * 3, ["ab", "c", "slow"])
    np.testing.assert_array_equal(result.total, [2.0, 1.0, np.nan])
    assert result.failures == {spec.name: 1} and "CallTimeout" in result.messages[spec.name]
    spec.fn.load_state_dict({"scored": 5})
    assert spec.fn.state_dict() == {"scored": 5}
