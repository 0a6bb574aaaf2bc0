"""The step factory (grpo_jax.learner.step_factory): micro-batched == whole batch, a non-finite
loss leaves the state bit-identical (counted), and the one optimizer builder's schedules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.config import MeshConfig, OptimizerConfig, config_from_dict
from grpo_jax.learner.optimizer import make_optimizer, run_optimizer, warm_start_optimizer
from grpo_jax.learner.step_factory import make_step, new_state
from grpo_jax.runtime.sharding import make_mesh, on_mesh, tree_shardings


def squared_error(batch):
    """Least squares over the whole batch's rows: each micro-batch's sum over the batch's count."""
    rows = batch["x"].shape[0]

    def micro_loss(params, micro, key):
        err = micro["x"] @ params["w"] + params["b"] - micro["y"]
        return jnp.sum(err ** 2) / rows, {"rows": jnp.asarray(micro["x"].shape[0], jnp.float32)}

    return micro_loss


def _setup(micro_batches: int, mesh):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}
    optimizer = make_optimizer(OptimizerConfig(learning_rate=0.1, max_grad_norm=0.5))
    state = on_mesh(new_state(params, optimizer), mesh)
    step = make_step(squared_error, optimizer, mesh=mesh, state_shardings=tree_shardings(state),
                     micro_batches=micro_batches)
    batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
    return state, step, batch


def test_two_micro_batches_give_the_whole_batch_update_and_a_nan_loss_changes_nothing():
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=1), jax.devices()[:2])
    (whole, step1, batch), (halves, step2, _) = _setup(1, mesh), _setup(2, mesh)
    for _ in range(3):
        whole, m1 = step1(whole, batch)
        halves, m2 = step2(halves, batch)
    np.testing.assert_allclose(halves.params["w"], whole.params["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m2["train/loss"], m1["train/loss"], rtol=1e-6)
    np.testing.assert_allclose(m2["train/grad_norm"], m1["train/grad_norm"], rtol=1e-6)
    assert float(m1["rows"]) == float(m2["rows"]) == 8  # sums add up over the micro-batches
    assert int(whole.step) == 3 and int(m1["train/skipped_steps"]) == 0
    assert np.isnan(m1["health/grad_noise_scale"]) and np.isfinite(m2["health/grad_noise_scale"])
    assert float(m1["train/grad_norm"]) > 0.5  # clipped: the optimizer's chain clips at 0.5

    before = jax.tree.map(np.asarray, halves)
    bad = {**batch, "y": batch["y"].copy()}
    bad["y"][5, 1] = np.nan  # one row of the second micro-batch
    after, metrics = step2(halves, bad)
    for old, new in zip(jax.tree.leaves(before.replace(step=0, skipped_total=0, skipped_streak=0)),
                        jax.tree.leaves(after.replace(step=0, skipped_total=0, skipped_streak=0))):
        assert np.asarray(new).tobytes() == np.asarray(old).tobytes()
    assert (int(after.step), int(metrics["train/skipped_steps"]), int(metrics["train/skipped_streak"])) == (4, 1, 1)


def test_every_optimizer_comes_from_its_sections_settings():
    """The warm start: constant rate, no clipping; the policy: the train section's warm-up; a
    cosine schedule reaches 0 at total_steps."""
    grads = {"w": jnp.full((2,), 100.0)}
    params = {"w": jnp.zeros((2,))}

    def first_update(optimizer):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return np.asarray(updates["w"])

    from runs import CONFIG

    config = config_from_dict({**CONFIG, "train": {**CONFIG["train"], "learning_rate": 0.01, "warmup_steps": 4,
                                                   "steps": 10, "lr_schedule": "constant"},
                               "sft": {**CONFIG["sft"], "learning_rate": 0.5}})
    assert config.train.optimizer == OptimizerConfig(learning_rate=0.01, warmup_steps=4, total_steps=10)
    np.testing.assert_allclose(first_update(run_optimizer(config)), 0.0)  # warm-up starts at 0
    # adamw's first step is -lr * sign(g) (minus weight decay on zero params): unclipped, constant.
    np.testing.assert_allclose(first_update(warm_start_optimizer(config)), -0.5, rtol=1e-5)
    cosine = make_optimizer(OptimizerConfig(learning_rate=1.0, lr_schedule="cosine", warmup_steps=1, total_steps=3))
    state = cosine.init(params)
    for _ in range(4):  # the fourth update is the one at step 3
        updates, state = cosine.update(grads, state, params)
    np.testing.assert_allclose(np.asarray(updates["w"]), 0.0, atol=1e-6)
    with pytest.raises(ValueError, match="optimizer.max_grad_norm must be > 0"):
        OptimizerConfig(learning_rate=1.0, max_grad_norm=0.0)
    assert isinstance(make_optimizer(OptimizerConfig(learning_rate=1.0, max_grad_norm=None)),
                      optax.GradientTransformation)
