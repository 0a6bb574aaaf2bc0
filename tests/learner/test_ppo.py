"""The critic baseline (issue 15): GAE against a plain NumPy loop (gamma and lambda not 1, ragged
right-padded masks), the value loss and explained variance against NumPy, and the PPO train step:
micro-batched == whole batch, and a value head that learns the returns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.config import GRPOConfig, PPOConfig
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.learner.ppo import explained_variance, gae, terminal_rewards, value_loss
from grpo_jax.learner.optimizer import pair_optimizer
from batches import make_batch, one_device_step, ppo_state


def gae_loop(rewards, values, mask, gamma, lam):
    """`lam`: one value or one per row."""
    B, T = rewards.shape
    lam_b = np.broadcast_to(np.asarray(lam, np.float64), (B,))
    adv = np.zeros((B, T))
    for b in range(B):
        n = int(mask[b].sum())  # real tokens are 0..n-1
        running = 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            running = delta + gamma * lam_b[b] * running
            adv[b, t] = running
    returns = (adv + values) * mask
    return adv, returns


@pytest.mark.parametrize("gamma, lam", [(0.9, 0.8), (1.0, 0.95), (0.99, 1.0), (0.5, 0.0)])
def test_gae_equals_a_numpy_loop_on_ragged_rows(gamma, lam):
    rng = np.random.default_rng(0)
    B, T = 5, 9
    lengths = [9, 1, 4, 0, 7]
    mask = (np.arange(T)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    rewards = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):  # a verifiable reward on the last real token, small shaping elsewhere
        rewards[b, :n] = rng.normal(scale=0.1, size=n)
        if n:
            rewards[b, n - 1] += rng.choice([0.0, 1.0])
    values = rng.normal(size=(B, T)).astype(np.float32)
    values_padded = np.where(mask > 0, values, 123.0).astype(np.float32)  # padding must not leak in
    want_adv, want_ret = gae_loop(rewards, values * mask, mask, gamma, lam)
    adv, ret = jax.jit(gae, static_argnames=("gamma", "lam"))(rewards, values_padded, mask, gamma=gamma, lam=lam)
    np.testing.assert_allclose(np.asarray(adv), want_adv, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), want_ret, atol=1e-5)
    assert np.all(np.asarray(adv)[mask == 0] == 0)


def test_decoupled_and_length_adaptive_gae_equal_a_numpy_loop():
    """VAPO: the policy's advantages with lambda = 1 - 1 / (alpha * l) per sequence, the critic's
    targets with lambda 1 (Monte Carlo returns), on ragged rows."""
    from grpo_jax.learner.ppo import length_adaptive_lambda

    rng = np.random.default_rng(1)
    B, T = 4, 12
    lengths = np.array([12, 3, 7, 1])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    rewards = np.where(np.arange(T)[None] == (lengths - 1)[:, None], rng.choice([0.0, 1.0], (B, 1)), 0.0)
    rewards = rewards.astype(np.float32)
    values = (rng.normal(size=(B, T)) * mask).astype(np.float32)
    lam_b = np.asarray(length_adaptive_lambda(jnp.asarray(mask), 0.2))
    np.testing.assert_allclose(lam_b, np.clip(1 - 1 / (0.2 * lengths), 0, 1), rtol=1e-6)
    assert lam_b[0] > lam_b[2] > 0 and lam_b[1] == lam_b[3] == 0  # longer rows bootstrap less
    adv, _ = jax.jit(gae, static_argnames=("gamma",))(rewards, values, mask, gamma=1.0, lam=jnp.asarray(lam_b))
    np.testing.assert_allclose(np.asarray(adv), gae_loop(rewards, values, mask, 1.0, lam_b)[0], atol=1e-5)
    _, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    mc = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1] * mask  # lambda 1: the return to go, whatever V
    np.testing.assert_allclose(np.asarray(ret), mc, atol=1e-5)


def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    rewards = np.array([[0.0, 0.0, 1.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], np.float32)
    adv, ret = gae(rewards=rewards, values=np.zeros_like(rewards), mask=mask, gamma=0.5, lam=1.0)
    np.testing.assert_allclose(np.asarray(ret), [[0.25, 0.5, 1.0, 0.0]])
    np.testing.assert_allclose(np.asarray(adv), np.asarray(ret))
    with pytest.raises(ValueError, match="gamma and lam in"):
        gae(rewards=rewards, values=rewards, mask=mask, gamma=1.5, lam=0.9)


def test_terminal_rewards_sit_on_the_last_real_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], np.int32)
    out = np.asarray(terminal_rewards(jnp.asarray([0.5, np.nan, -1.0], jnp.float32), jnp.asarray(mask)))
    want = np.zeros((3, 4), np.float32)
    want[0, 2], want[2, 3] = 0.5, -1.0  # a dropped (NaN) reward gives nothing
    np.testing.assert_array_equal(out, want)


def test_value_loss_and_explained_variance_against_numpy():
    rng = np.random.default_rng(5)
    v, old, ret = (rng.normal(size=(4, 6)).astype(np.float32) for _ in range(3))
    clip = 0.3
    clipped = old + np.clip(v - old, -clip, clip)
    want = 0.5 * np.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    np.testing.assert_allclose(np.asarray(value_loss(jnp.asarray(v), jnp.asarray(old), jnp.asarray(ret), clip)), want,
                               rtol=1e-6)
    mask = rng.random((4, 6)) < 0.7
    err = (ret - v)[mask]
    sums = {"n": mask.sum(), "ret": ret[mask].sum(), "ret2": (ret[mask] ** 2).sum(), "err": err.sum(),
            "err2": (err**2).sum()}
    ev = float(explained_variance({k: jnp.float32(x) for k, x in sums.items()}))
    assert ev == pytest.approx(1 - np.var(err) / np.var(ret[mask]), rel=1e-4)


def _ppo_state(optimizer, seed=0):
    return ppo_state(optimizer, "head", seed, model=Transformer(tiny("qwen3"), rngs=nnx.Rngs(seed)))[:2]


@pytest.mark.parametrize("kind, ppo", [
    ("head", PPOConfig(gamma=0.9, lam_policy=0.8, lam_critic=0.9, length_adaptive_alpha=0.5)),
    # A separate critic model (issue 30) with the positive-example loss and its whole-batch normaliser.
    ("model", PPOConfig(critic="model", positive_lm_coef=0.2, lam_policy=0.9, length_adaptive_alpha=0.5)),
])
def test_ppo_step_micro_batched_equals_whole_batch(kind, ppo):
    # SGD with lr 1: the parameter difference is the gradient difference, for the trunk and the head.
    opt = pair_optimizer(optax.sgd(1.0), optax.sgd(1.0))
    batch = make_batch(rewards=[1, 0, 0, 1, 0, 0, 0, 1])
    out = []
    for k in (1, 4):
        graphdef, state, critic_graphdef = (*_ppo_state(opt), None) if kind == "head" else ppo_state(opt, "model")
        step = one_device_step(graphdef, opt, GRPOConfig(), state, micro_batches=k, logprob_chunk=2,
                               critic_graphdef=critic_graphdef, ppo_config=ppo)
        state, metrics = step(state, batch)
        out.append((jax.tree.leaves((state.params, state.critic)), {k_: float(v) for k_, v in metrics.items()}))
    (p1, m1), (p4, m4) = out
    for a, b in zip(p1, p4):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    keys = ("train/loss", "value/loss", "value/explained_variance") + (
        ("train/positive_lm_loss",) if ppo.positive_lm_coef else ())
    for key in keys:
        assert m1[key] == pytest.approx(m4[key], abs=1e-5), key
    assert np.isfinite(m4["health/grad_noise_scale"]) and np.isnan(m1["health/grad_noise_scale"])


def test_ppo_steps_fit_the_value_head_to_the_returns():
    opt = pair_optimizer(optax.sgd(0.0), optax.adam(3e-2))
    graphdef, state = _ppo_state(opt)
    step = one_device_step(graphdef, opt, GRPOConfig(), state, logprob_chunk=2,
                           ppo_config=PPOConfig(gamma=1.0, lam_critic=1.0, lam_policy=1.0, value_clip=10.0))
    batch = make_batch(rewards=[1, 0, 0, 1, 0, 1, 0, 1])
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["value/loss"]))
    # Policy frozen (lr 0): only the head learns; with lambda = 1 the returns are the rewards.
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(metrics["value/explained_variance"]) > 0.3


def test_value_warmup_steps_are_plain_regression_on_the_monte_carlo_returns():
    """Issue 46's check of the critic machinery (a flat explained variance on the credit task): a
    critic model's warm-up steps, micro-batched with the shared-prompt pass, move its parameters as
    Adam on the mean squared error to each row's reward over its completion tokens does, computed
    here without the step (no policy terms, nothing clipped or skipped, the returns as they should be).
    SGD (Adam would magnify float dust in a gradient that should be 0)."""
    from grpo_jax.learner.logprobs import completion_states
    from grpo_jax.learner.ppo import values

    opt = pair_optimizer(optax.sgd(0.1), optax.sgd(0.1))  # the policy's rate too: the warm-up must hold it
    graphdef, state, critic_graphdef = ppo_state(opt, "model")
    critic, tx = jax.tree.map(jnp.copy, state.critic), optax.sgd(0.1)  # the step donates its state
    opt_state = tx.init(critic)
    step = one_device_step(graphdef, opt, GRPOConfig(), state, micro_batches=2, group_size=4,
                           critic_graphdef=critic_graphdef, ppo_config=PPOConfig(critic="model", value_warmup_steps=9))

    def mse(c, b):
        h = completion_states(nnx.merge(critic_graphdef, c["model"]), b.prompt_ids, b.prompt_mask, b.completion_ids)
        m = b.completion_mask.astype(jnp.float32)
        # value_coef (0.5) x the PPO2 loss's 0.5 x the squared error's token mean
        return 0.25 * jnp.sum((values(c, h) - b.rewards[:, None]) ** 2 * m) / m.sum()

    grad = jax.jit(jax.grad(mse))
    params0 = jax.tree.map(jnp.copy, state.params)
    for seed in range(3):
        b = make_batch(seed=seed)
        b = b.replace(prompt_ids=jnp.repeat(b.prompt_ids[::4], 4, axis=0), prompt_mask=jnp.repeat(b.prompt_mask[::4], 4, axis=0))
        state, metrics = step(state, b)
        updates, opt_state = tx.update(grad(critic, b), opt_state, critic)
        critic = optax.apply_updates(critic, updates)
        assert float(metrics["value/warmup"]) == 1.0
    for got, want in zip(jax.tree.leaves(state.critic), jax.tree.leaves(critic)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.critic), jax.tree.leaves(ppo_state(opt, "model")[1].critic))) > 1e-3
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
