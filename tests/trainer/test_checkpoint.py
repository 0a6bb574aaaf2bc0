"""Checkpoints and resume without a run: a saved step restores the train state, the KL reference,
the prompt stream's position and the state of rewards that keep one; a checkpoint that does not
fit this run is a ConfigError."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_jax.trainer.checkpoint import Checkpointer, save_step
from grpo_jax.trainer.run_state import CheckpointMeta
from grpo_jax.config import ConfigError, OptimizerConfig
from grpo_jax.data import IndexSampler
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.rewards import RewardSpec, RewardStates
from grpo_jax.rewards.reward_model import RewardModelReward, RunningMoments
from grpo_jax.learner.optimizer import make_optimizer
from grpo_jax.learner.train_step import init_state
from grpo_jax.trainer.resume import resume


class Moments(RewardModelReward):
    """The reward model's state handling without a model."""

    def __init__(self):
        self.moments = RunningMoments()


def state_of(seed: int):
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    return init_state(Transformer(tiny("llama"), rngs=nnx.Rngs(seed)), optimizer)[1]


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_saved_step_resumes_state_reference_and_stream(tmp_path):
    saved, reference = state_of(0), state_of(1).params
    stream = IndexSampler(50, seed=3)
    stream.next(17)
    normaliser = Moments()  # a reward with state (a reward model's running normalisation)
    normaliser.moments.update(np.array([1.0, 2.0, 4.0]))
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    rewards = RewardStates([RewardSpec("rm", normaliser), RewardSpec("plain", lambda p, c, **_: [0.0] * len(c))])
    save_step(checkpointer, 5, saved, components={"data": stream, "rewards": rewards}, seed=3, reference=reference)
    checkpointer.close()

    fresh = IndexSampler(50, seed=3)
    restored_normaliser = Moments()
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    assert checkpointer.all_steps()[0] == 5
    state, ref = resume(checkpointer, 5, state_of(2), stream=fresh, reference=state_of(2).params,
                        rewards=[RewardSpec("rm", restored_normaliser)])
    assert restored_normaliser.state_dict() == normaliser.state_dict() and restored_normaliser.moments.count == 3
    for a, b in zip(leaves(saved), leaves(state)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(reference), leaves(ref)):
        np.testing.assert_array_equal(a, b)
    assert fresh.state_dict() == stream.state_dict() and fresh.next(3) == stream.next(3)

    with pytest.raises(ConfigError, match="cannot resume step 5 with this config.*seed"):
        resume(checkpointer, 5, state_of(2), stream=IndexSampler(50, seed=4))
    checkpointer.close()


def test_a_checkpoint_of_another_host_count_is_refused(tmp_path):
    stream = IndexSampler(50, seed=3)
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(2, state_of(0), CheckpointMeta(step=2, seed=3, components={"data": (stream.state_dict(),) * 2}))
    checkpointer.close()
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    with pytest.raises(ConfigError, match="written by 2 processes, this run has 1"):
        resume(checkpointer, 2, state_of(0), stream=stream)
    checkpointer.close()
