"""Issue 15 end to end on the trainer's test task (1-digit addition, tests/trainer/test_loop.py's CONFIG):
a short PPO run raises the reward and its critic logs its metrics; a GRPO run on coin-flip rewards
(reward_control: random) does not raise held-out accuracy in the same number of steps; every
run logs the health metrics, the pass-rate histogram, and a second verifier's agreement."""

from __future__ import annotations

import numpy as np
import pytest
from runs import CONFIG, write_config

from grpo_jax import cli
from grpo_jax.observe.writers import read_metrics

STEPS = 40


def _train(tmp_path_factory, name, **top):
    tmp = tmp_path_factory.mktemp(name)
    config = {**CONFIG, **top, "data": {**CONFIG["data"], "data_dir": str(tmp / "tfds")},
              "train": {**CONFIG["train"], "steps": STEPS, "micro_batches": 2},
              "eval": {**CONFIG["eval"], "every": 0, "verifier": "math_accuracy",
                       "verifier_kwargs": {"verifier": "math_verify"}},
              "checkpoint": {"every": 0}}
    out = tmp / "run"
    assert cli.main(["train", "--config", write_config(tmp, config), "--output", str(out)]) == 0
    return read_metrics(out), out


@pytest.fixture(scope="module")
def ppo(tmp_path_factory):
    return _train(tmp_path_factory, "ppo", algorithm="ppo", ppo={"critic_learning_rate": 0.003})


@pytest.fixture(scope="module")
def random_reward(tmp_path_factory):
    return _train(tmp_path_factory, "random", reward_control="random")


def _rewards(records):
    return [r["reward/mean"] for r in records if "reward/mean" in r]


def test_a_short_ppo_run_raises_the_reward(ppo):
    records, _ = ppo
    rewards = _rewards(records)
    assert len(rewards) == STEPS
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    # Measured with this seed: 0.29 -> 0.44.
    assert last > first + 0.08, (first, last)
    train = [r for r in records if "value/loss" in r]
    assert len(train) == STEPS and all(np.isfinite(r["value/explained_variance"]) for r in train[1:])
    # The head starts at 0 and learns the mean return; the value loss falls below its start.
    assert np.mean([r["value/loss"] for r in train[-10:]]) < train[0]["value/loss"]


def test_coin_flip_rewards_do_not_raise_heldout_accuracy(random_reward):
    records, _ = random_reward
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    rewards = _rewards(records)
    # Measured with this seed: accuracy 0.23 -> 0.08 and true reward 0.21 -> 0.10: coin flips push the
    # policy around at random and it forgets the warm start (GRPO on the real rewards,
    # tests/trainer/test_loop.py: reward 0.23 -> 0.40 in the same 40 steps).
    assert evals[-1] < evals[0] + 0.05, evals
    assert np.mean(rewards[-10:]) < np.mean(rewards[:10]) + 0.05


def test_every_run_logs_the_health_metrics(ppo, random_reward):
    for records, out in (ppo, random_reward):
        train = [r for r in records if "reward/mean" in r]
        for key in ("health/frac_zero_std_expected", "health/grad_noise_scale", "health/sampler_train_logprob_diff",
                    "health/sampler_train_logprob_diff_max", "health/distinct_answers", "health/pass_rate",
                    "groups/frac_all_correct", "groups/frac_all_wrong", "completion/truncated_frac"):
            assert all(key in r for r in train), key
        assert all(np.isfinite(r["health/grad_noise_scale"]) and r["health/grad_noise_scale"] > 0 for r in train)
        # f32 sampler and trainer: the same policy to float rounding.
        assert max(r["health/sampler_train_logprob_diff_max"] for r in train) < 1e-3
        evals = [r for r in records if "eval/accuracy" in r]
        assert len(evals) == 2
        for e in evals:  # numbers only: the regex and the symbolic judge agree
            assert e["health/verifier_disagreement"] == 0.0
            assert e["eval/verifier_accuracy"] == pytest.approx(e["eval/accuracy"])
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"), size_guidance={"histograms": 0}).Reload()
        histograms = events.Histograms("health/pass_rate")
        assert len(histograms) == STEPS and histograms[0].histogram_value.num == CONFIG["data"]["prompts_per_step"]
