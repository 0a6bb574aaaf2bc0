"""GAE against a plain NumPy loop (issue 15): gamma and lambda not 1, ragged right-padded masks."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from grpo_jax.ppo import gae


def gae_loop(rewards, values, mask, gamma, lam):
    B, T = rewards.shape
    adv = np.zeros((B, T))
    for b in range(B):
        n = int(mask[b].sum())  # real tokens are 0..n-1
        running = 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            running = delta + gamma * lam * running
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


def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    rewards = np.array([[0.0, 0.0, 1.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], np.float32)
    adv, ret = gae(rewards=rewards, values=np.zeros_like(rewards), mask=mask, gamma=0.5, lam=1.0)
    np.testing.assert_allclose(np.asarray(ret), [[0.25, 0.5, 1.0, 0.0]])
    np.testing.assert_allclose(np.asarray(adv), np.asarray(ret))
    with pytest.raises(ValueError, match="gamma and lam in"):
        gae(rewards=rewards, values=rewards, mask=mask, gamma=1.5, lam=0.9)
