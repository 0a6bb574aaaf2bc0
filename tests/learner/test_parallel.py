"""The pmap mode (pure data parallelism, replicated state) runs the same train_step and gives the
same update as the jit mode."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.config import GRPOConfig, SamplingConfig
from grpo_jax.learner.grpo import group_advantages
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.engine.sampling import generate
from grpo_jax.runtime.sharding import replicate, split_rows, unreplicate
from grpo_jax.learner.pmap import pmap_step
from grpo_jax.learner.train_step import Batch, init_state
from batches import one_device_step, step_spec

N, G = 8, 4


def rollout_batch(policy):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 5, 8, 2, 7, 4, 6, 8)]
    config = SamplingConfig(group_size=G, max_new_tokens=6, stop_token_ids=(2,), prompt_buckets=(8,), attend_phases=1)
    out = generate(policy, prompts, config, jax.random.key(3))
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    rewards = np.array([np.mean(t[:n] % 3 == 0) if n else 0.0 for t, n in zip(tokens, lengths)], np.float32)
    rewards[5] = np.nan  # a dropped sample: the normaliser must count the whole batch's tokens
    adv = group_advantages(jax.numpy.asarray(rewards), G)
    return Batch(prompt_ids=np.repeat(np.asarray(out.prompt_ids), G, 0), prompt_mask=np.repeat(np.asarray(out.prompt_mask), G, 0),
                 completion_ids=tokens, completion_mask=np.asarray(out.mask), rewards=rewards,
                 advantages=np.asarray(adv.advantages), valid=np.asarray(adv.valid), zero_std=np.asarray(adv.zero_std),
                 truncated=np.asarray(out.truncated), old_logprobs=np.asarray(out.logprobs))


# token_mean (the demo's) is compared at the trainer level too, pmap against one device
# (tests/trainer/test_multihost.py); here the per-sequence normaliser, with a dropped sample.
@pytest.mark.parametrize("loss_agg", ["seq_mean_token_mean"])
def test_pmap_mode_gives_the_jit_modes_update(loss_agg):
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5))  # SGD: see test_sharding
    config = GRPOConfig(loss_agg=loss_agg)
    policy = Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))
    batch = rollout_batch(policy)

    graphdef, state = init_state(policy, opt)
    jit_state, jit_metrics = one_device_step(graphdef, opt, config, state, micro_batches=2)(
        state, jax.tree.map(np.asarray, batch))

    devices = jax.local_devices()[:8]
    assert len(devices) == 8
    graphdef, state = init_state(Transformer(tiny("qwen3"), rngs=nnx.Rngs(0)), opt)
    step = pmap_step(step_spec(graphdef, opt, config, micro_batches=2), devices)  # as PmapLearner builds it
    pm_state, pm_metrics = step(replicate(state, devices), split_rows(batch, len(devices)))

    for a, b in zip(jax.tree.leaves(jit_state.params), jax.tree.leaves(unreplicate(pm_state).params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    # every device holds the same parameters
    for leaf in jax.tree.leaves(pm_state.params):
        assert all(np.array_equal(np.asarray(leaf[0]), np.asarray(leaf[i])) for i in range(1, 8))
    for key in ("train/loss", "train/grad_norm", "policy/entropy", "advantage/mean", "advantage/std",
                "advantage/abs_max", "completion/len_mean", "completion/len_max", "completion/truncated_frac",
                "policy/ratio_max"):
        assert float(pm_metrics[key][0]) == pytest.approx(float(jit_metrics[key]), abs=1e-5), key
    assert float(jit_metrics["train/grad_norm"]) > 0


def test_unknown_modes_are_refused_and_rows_must_split_over_devices():
    from grpo_jax.config import ConfigError, config_from_dict

    # The mode is chosen once, from the config (learner.modes.make_learner): another is refused there.
    with pytest.raises((ConfigError, ValueError), match="pjit"):
        config_from_dict({"parallelism": "pjit"})
    with pytest.raises(ValueError, match="do not split over 3 devices"):
        split_rows(np.zeros((8, 2)), 3)
