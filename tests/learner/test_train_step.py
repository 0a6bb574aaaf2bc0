"""The train step: micro-batching equivalence, non-finite skipping, mu=1 semantics, a learning signal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.config import GRPOConfig, OptimizerConfig
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.learner.optimizer import make_optimizer
from grpo_jax.learner.step_factory import check_skips
from grpo_jax.learner.train_step import init_state
from batches import fresh, make_batch, one_device_step

def test_micro_batches_give_the_same_update():
    # SGD with lr 1: the parameter difference is the gradient difference. (Adam's first step,
    # lr * g / (|g| + eps), turns float-rounding noise in near-zero gradients into lr-sized steps.)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    batch = make_batch(rewards=[1, 0, 0, 1, 0, 0, 0, 1])
    batch = batch.replace(ref_logprobs=batch.old_logprobs + 0.1)
    results = []
    for cfg in (GRPOConfig(), GRPOConfig(loss_agg="seq_mean_token_mean"),
                GRPOConfig(policy_loss="cispo", cispo_max_ratio=1.1, beta=0.04, kl_importance_weighted=True),
                GRPOConfig(loss_agg="seq_mean_token_sum_norm", max_completion_length=5, mask_truncated=True,
                           std_ddof=1)):
        for k in (1, 4):
            graphdef, state = fresh(opt)
            step = one_device_step(graphdef, opt, cfg, state, micro_batches=k, logprob_chunk=2)
            state, metrics = step(state, batch)
            results.append((jax.tree.leaves(state.params), float(metrics["train/loss"])))
        (p1, l1), (p4, l4) = results[-2:]
        assert abs(l1 - l4) <= 1e-6
        for a, b in zip(p1, p4):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
        assert any(float(jnp.abs(a - b).max()) > 0 for a, b in
                   zip(p1, jax.tree.leaves(fresh(opt)[1].params))), "the step changed nothing"


def test_non_finite_gradient_skips_the_update_bit_identically():
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = fresh(opt)
    step = one_device_step(graphdef, opt, GRPOConfig(), state)
    state, _ = step(state, make_batch(1))  # a normal step first, so the optimizer state is non-trivial
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    bad = make_batch(2)
    bad = bad.replace(advantages=bad.advantages.at[0].set(jnp.nan))  # an injected NaN reaches the gradient
    for streak in (1, 2):
        state, metrics = step(state, bad)
        assert int(metrics["train/skipped_steps"]) == streak and int(metrics["train/skipped_streak"]) == streak
        after = jax.tree.map(np.asarray, (state.params, state.opt_state))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(FloatingPointError, match="2 consecutive"):
        check_skips(metrics, 2)
    state, metrics = step(state, make_batch(3))
    assert int(metrics["train/skipped_streak"]) == 0 and int(metrics["train/skipped_steps"]) == 2
    check_skips(metrics, 2)


def test_mu_one_uses_the_current_policy_as_old():
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = fresh(opt)
    _, m1 = one_device_step(graphdef, opt, GRPOConfig(), state)(state, make_batch(4))
    assert float(m1["policy/ratio_max"]) == 1.0 and float(m1["policy/clip_frac_low"]) == 0.0
    graphdef, state = fresh(opt)
    _, m2 = one_device_step(graphdef, opt, GRPOConfig(num_iterations=2), state)(state, make_batch(4))
    # The stored old log-probs (about -3) are not the model's (about -5.5 for random tokens of 256).
    assert abs(float(m2["policy/ratio_max"]) - 1.0) > 0.5


def test_a_step_raises_the_logprob_of_rewarded_completions():
    from grpo_jax.learner.logprobs import completion_logprobs

    opt = make_optimizer(OptimizerConfig(learning_rate=3e-3))
    graphdef, state = fresh(opt)
    batch = make_batch(5, rewards=[1, 0, 0, 0, 0, 1, 0, 0])
    step = one_device_step(graphdef, opt, GRPOConfig(), state)

    def logp(params):
        lp, _ = completion_logprobs(nnx.merge(graphdef, params), batch.prompt_ids, batch.prompt_mask,
                                    batch.completion_ids)
        return np.asarray((lp * batch.completion_mask).sum(1))

    start = logp(state.params)
    for _ in range(3):
        state, metrics = step(state, batch)
    delta = logp(state.params) - start
    assert delta[0] > 0 and delta[5] > 0 and (delta[[1, 2, 3, 4, 6, 7]] < 0).all()
    for name in ("advantage/mean", "advantage/abs_max", "completion/len_mean", "policy/entropy", "train/grad_norm"):
        assert np.isfinite(float(metrics[name])), name
    # Reward statistics come from the rollouts (grpo_jax.rollout.collect.reward_metrics), not twice.
    assert not {"reward/mean", "reward/std", "groups/frac_zero_std"} & set(metrics)
    # Two groups of four, one rewarded sample each: +-sqrt(3) after the group std, mean zero.
    assert float(metrics["advantage/abs_max"]) == pytest.approx(np.sqrt(3.0), rel=1e-4)


def test_bf16_compute_with_fp32_master_params():
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    model = Transformer(tiny("qwen3"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32)
    graphdef, state = init_state(model, opt)
    state, metrics = one_device_step(graphdef, opt, GRPOConfig(), state)(state, make_batch(6))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert np.isfinite(float(metrics["train/loss"])) and int(metrics["train/skipped_steps"]) == 0
    assert float(metrics["train/grad_norm"]) > 0


@pytest.mark.parametrize("field,change,message", [
    ("completion_mask", lambda b: b.completion_mask[:, :-1], "Batch.completion_mask"),
    ("rewards", lambda b: b.rewards.astype(jnp.int32), "Batch.rewards"),
    ("zero_std", lambda b: jnp.zeros(3, bool), "rows must be N x G"),
    ("valid", lambda b: b.valid.astype(jnp.float32), "Batch.valid"),
    ("ref_logprobs", lambda b: b.old_logprobs[:, :2], "Batch.ref_logprobs"),
])
def test_a_malformed_batch_names_its_field(field, change, message):
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    graphdef, state = fresh(opt)
    batch = make_batch(7)
    bad = batch.replace(**{field: change(batch)})
    with pytest.raises(ValueError, match=message):
        one_device_step(graphdef, opt, GRPOConfig(), state)(state, bad)
    with pytest.raises(ValueError, match="do not split into train.micro_batches=3"):
        one_device_step(graphdef, opt, GRPOConfig(), state, micro_batches=3)(state, batch)

