"""group_advantages and the KL estimators against NumPy references written here, plus properties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.groups import uniform_groups
from grpo_jax.learner.grpo import group_advantages, kl_estimate


def reference_advantages(rewards, G, scale, estimator, eps=1e-6, ddof=0):
    """Loop-by-loop NumPy reference: one group at a time, dropped (NaN) samples excluded."""
    r = np.asarray(rewards, np.float64).reshape(-1, G)
    out = np.zeros_like(r)
    valid_all = ~np.isnan(r)
    batch_vals = r[valid_all]
    batch_std = batch_vals.std(ddof=ddof) if batch_vals.size else 0.0
    zero = []
    for i, row in enumerate(r):
        idx = [j for j in range(G) if not np.isnan(row[j])]
        vals = row[idx]
        if len(vals) < 2 or vals.max() == vals.min():
            zero.append(True)
            continue
        zero.append(False)
        for j in idx:
            if estimator == "grpo":
                a = row[j] - vals.mean()
            else:
                others = [row[k] for k in idx if k != j]
                a = row[j] - np.mean(others)
            if scale == "group":
                a /= vals.std(ddof=ddof) + eps
            elif scale == "batch":
                a /= batch_std + eps
            out[i, j] = a
    return out.reshape(-1), np.array(zero)


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_matches_numpy_reference(scale, estimator, ddof):
    rng = np.random.default_rng(0)
    G = 4
    rewards = rng.normal(size=6 * G).astype(np.float32)
    rewards[4:8] = 0.1  # a zero-variance group
    rewards[9] = np.nan  # a dropped sample
    rewards[12:15] = np.nan  # a group with one valid sample
    rewards[16:20] = [1, 0, 0, 0]  # binary rewards
    out = group_advantages(jnp.asarray(rewards), G, scale=scale, estimator=estimator, ddof=ddof)
    ref, zero = reference_advantages(rewards, G, scale, estimator, ddof=ddof)
    np.testing.assert_allclose(np.asarray(out.advantages), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.zero_std), zero)
    np.testing.assert_array_equal(np.asarray(out.valid), ~np.isnan(rewards))
    assert np.asarray(out.advantages)[9] == 0.0 and np.isfinite(np.asarray(out.advantages)).all()


def test_bessel_corrected_advantages_are_trls_sqrt_of_three_quarters_at_group_size_four():
    rewards = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    ours, trl = (np.asarray(group_advantages(rewards, 4, ddof=d, eps=0.0).advantages) for d in (0, 1))
    np.testing.assert_allclose(trl, ours * np.sqrt(3 / 4), rtol=1e-6)  # 0.866x, as TRL's torch.std


def test_equal_rewards_give_exactly_zero():
    for value in (0.1, 1.0, -3.7, 1e-8):
        out = group_advantages(jnp.full((8,), value, jnp.float32), 4)
        assert (np.asarray(out.advantages) == 0.0).all()
        assert np.asarray(out.zero_std).all()


def test_group_advantages_sum_to_zero_and_permuting_groups_commutes():
    rng = np.random.default_rng(1)
    G, N = 8, 5
    rewards = rng.integers(0, 3, N * G).astype(np.float32)
    adv = np.asarray(group_advantages(jnp.asarray(rewards), G).advantages).reshape(N, G)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-5)
    perm = rng.permutation(N)
    permuted = rewards.reshape(N, G)[perm].reshape(-1)
    adv_p = np.asarray(group_advantages(jnp.asarray(permuted), G).advantages).reshape(N, G)
    np.testing.assert_array_equal(adv_p, adv[perm])


def test_bad_arguments_are_refused():
    r = jnp.zeros((8,))
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(r, 1)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(r, 3)
    with pytest.raises(ValueError, match="scale='std'"):
        group_advantages(r, 4, scale="std")
    with pytest.raises(ValueError, match="estimator='ppo'"):
        group_advantages(r, 4, estimator="ppo")
    with pytest.raises(ValueError, match="kl estimator='k4'"):
        kl_estimate(r, r, "k4")


def test_kl_estimators_match_analytic_kl_on_a_toy_categorical():
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    q = np.array([0.3, 0.3, 0.2, 0.1, 0.1])
    analytic = float(np.sum(p * np.log(p / q)))
    n = 200_000
    samples = np.asarray(jax.random.categorical(jax.random.key(0), jnp.log(jnp.asarray(p)), shape=(n,)))
    logp = jnp.asarray(np.log(p)[samples], jnp.float32)
    logq = jnp.asarray(np.log(q)[samples], jnp.float32)
    for est in ("k1", "k3"):
        vals = np.asarray(kl_estimate(logp, logq, est), np.float64)
        se = vals.std() / np.sqrt(n)
        assert abs(vals.mean() - analytic) < 3 * se, (est, vals.mean(), analytic, se)
    assert (np.asarray(kl_estimate(logp, logq, "k3")) >= 0).all()
    assert (np.asarray(kl_estimate(logp, logq, "k2")) >= 0).all()
    for est in ("k1", "k2", "k3"):
        assert (np.asarray(kl_estimate(logp, logp, est)) == 0).all()


def test_overlong_penalty_matches_the_dapo_formula():
    from grpo_jax.groups import overlong_penalty

    L_max, L_cache = 20, 8
    lengths = np.arange(0, 25)
    out = np.asarray(overlong_penalty(jnp.asarray(lengths), L_max, L_cache))
    for n, v in zip(lengths, out):
        if n <= L_max - L_cache:
            expected = 0.0
        elif n <= L_max:
            expected = ((L_max - L_cache) - n) / L_cache
        else:
            expected = -1.0
        assert abs(v - expected) < 1e-6, (n, v, expected)
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(jnp.asarray(lengths), 10, 11)


def test_uniform_groups_ignore_dropped_samples():
    nan = np.nan
    total = np.array([1, 1, 1, 1,  0, 1, 0, 0,  nan, 1, nan, 1,  nan, nan, nan, 0.5,  nan, 0, 1, nan], np.float32)
    # equal / mixed / equal after dropping NaN / one judged sample / mixed after dropping NaN
    assert np.asarray(uniform_groups(total, 4)).tolist() == [True, False, True, True, False]
    assert np.asarray(uniform_groups(total[:16], 4)).tolist() == [True, False, True, True]
    assert np.asarray(uniform_groups(total[16:], 4)).tolist() == [False]
    # The same groups are the ones group_advantages calls zero_std.
    adv = group_advantages(jnp.asarray(total), 4)
    assert np.asarray(adv.zero_std).tolist() == [True, False, True, True, False]
