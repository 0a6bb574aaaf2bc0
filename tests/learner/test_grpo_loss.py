"""The GRPO policy loss against a NumPy reference, clipping and GSPO gradients, config validation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.config import GRPOConfig, RunConfig, SamplingConfig
from grpo_jax.learner.grpo import group_advantages, loss_metrics, policy_loss


def batch(seed=0, lengths=(1, 100, 37, 64), M=100):
    rng = np.random.default_rng(seed)
    R = len(lengths)
    logp = np.log(rng.uniform(0.05, 0.95, (R, M))).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (R, M))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.2, (R, M))).astype(np.float32)
    mask = (np.arange(M)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    adv = rng.normal(size=R).astype(np.float32)
    return logp, old, ref, mask, adv


def reference_loss(logp, old, ref, mask, adv, cfg):
    """Row-by-row, token-by-token NumPy reference in float64."""
    logp, old, ref, mask, adv = (np.asarray(x, np.float64) for x in (logp, old, ref, mask, adv))
    per = np.zeros_like(logp)
    for i in range(logp.shape[0]):
        n = mask[i].sum()
        seq_ratio = np.exp(((logp[i] - old[i]) * mask[i]).sum() / max(n, 1))
        for t in range(logp.shape[1]):
            ratio = seq_ratio if cfg.ratio_level == "sequence" else np.exp(logp[i, t] - old[i, t])
            if cfg.policy_loss == "cispo":  # the weight's value (its gradient is stopped)
                obj = min(ratio, cfg.cispo_bound) * adv[i] * logp[i, t]
            else:
                obj = min(ratio * adv[i], np.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * adv[i])
            if cfg.dual_clip is not None and adv[i] < 0:
                obj = max(obj, cfg.dual_clip * adv[i])
            d = logp[i, t] - ref[i, t]
            kl = {"k1": d, "k2": d * d / 2, "k3": np.exp(-d) - 1 + d}[cfg.kl_estimator]
            per[i, t] = -obj + cfg.beta * kl * (ratio if cfg.kl_importance_weighted else 1.0)
    if cfg.loss_agg == "token_mean":
        return (per * mask).sum() / mask.sum()
    rows = [i for i in range(len(adv)) if mask[i].sum() > 0]
    if cfg.loss_agg == "seq_mean_token_mean":
        return np.mean([(per[i] * mask[i]).sum() / mask[i].sum() for i in rows])
    return (per * mask).sum() / (len(adv) * cfg.max_completion_length)  # Dr. GRPO: every row x L_max


CONFIGS = [
    GRPOConfig(),
    GRPOConfig(epsilon_high=0.28, loss_agg="seq_mean_token_mean"),
    GRPOConfig(loss_agg="seq_mean_token_sum_norm", max_completion_length=100, dual_clip=3.0),
    GRPOConfig(beta=0.04, kl_estimator="k3"),
    GRPOConfig(beta=0.1, kl_estimator="k1", loss_agg="seq_mean_token_mean"),
    GRPOConfig(beta=0.1, kl_estimator="k2", epsilon_low=0.1, epsilon_high=0.3, dual_clip=2.0),
    GRPOConfig(policy_loss="cispo", cispo_max_ratio=1.2, beta=0.04),
    GRPOConfig(policy_loss="cispo", cispo_max_ratio=1.5, loss_agg="seq_mean_token_mean"),
    GRPOConfig(beta=0.1, kl_importance_weighted=True),
    GRPOConfig(beta=0.1, kl_importance_weighted=True, kl_estimator="k1", loss_agg="seq_mean_token_sum_norm",
               max_completion_length=100),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.loss_agg}-b{c.beta}-{c.kl_estimator}-"
                                                     f"dc{c.dual_clip}-iw{c.kl_importance_weighted}")
def test_loss_matches_numpy_reference(cfg):
    logp, old, ref, mask, adv = batch()
    loss, sums = policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg,
                             ref_logprobs=jnp.asarray(ref))
    metrics = loss_metrics(sums)
    np.testing.assert_allclose(float(loss), reference_loss(logp, old, ref, mask, adv, cfg), rtol=2e-5, atol=1e-6)
    ratio = np.exp(logp - old)
    sel = mask > 0
    low = ((ratio < 1 - cfg.epsilon_low) & (adv[:, None] < 0))[sel].mean()
    np.testing.assert_allclose(float(metrics["policy/clip_frac_low"]), low, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["policy/ratio_max"]), ratio[sel].max(), rtol=1e-6)
    if cfg.beta > 0:
        np.testing.assert_allclose(float(metrics["kl/k1"]), (logp - ref)[sel].mean(), rtol=1e-4)
        d = (logp - ref)[sel].astype(np.float64)
        np.testing.assert_allclose(float(metrics["kl/k3"]), (np.exp(-d) - 1 + d).mean(), rtol=1e-4)


def test_cispo_gradient_is_reinforce_with_the_clipped_weight_held_fixed():
    """d loss / d log pi = -min(ratio, bound) A / normaliser at every loss token: the weight passes
    no gradient, and tokens past the bound still learn (unlike the clipped surrogate)."""
    cfg = GRPOConfig(policy_loss="cispo", cispo_max_ratio=1.2)
    logp, old, _, mask, adv = batch(4)
    grad = np.asarray(jax.grad(lambda lp: policy_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                                      cfg)[0])(jnp.asarray(logp)))
    w = np.minimum(np.exp(logp - old), 1.2)
    np.testing.assert_allclose(grad, -w * adv[:, None] * mask / mask.sum(), rtol=1e-5, atol=1e-9)
    assert (np.exp(logp - old)[mask > 0] > 1.2).any() and (grad[(np.exp(logp - old) > 1.2) & (mask > 0)] != 0).all()


def test_dr_grpo_normaliser_stays_constant_when_rows_are_masked():
    """With mask_truncated and a dropped row, Dr. GRPO still divides by every row x L_max."""
    logp, old, ref, mask, adv = batch(5)
    cfg = GRPOConfig(loss_agg="seq_mean_token_sum_norm", max_completion_length=100, mask_truncated=True)
    valid, truncated = jnp.array([True, False, True, True]), jnp.array([False, False, True, False])
    loss, _ = policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg,
                          valid=valid, truncated=truncated)
    kept = mask * np.array([1, 0, 0, 1], np.float32)[:, None]
    want = reference_loss(logp, old, ref, kept, adv, cfg)  # rows 1 and 2 add nothing, but still count
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)


def test_gspo_matches_reference_and_gives_the_policy_gradient_at_ratio_one():
    cfg = GRPOConfig(ratio_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4, loss_agg="seq_mean_token_mean")
    logp, old, ref, mask, adv = batch(1)
    loss, _ = policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg)
    np.testing.assert_allclose(float(loss), reference_loss(logp, old, ref, mask, adv, cfg), rtol=2e-5)
    # policy == old: the gradient is REINFORCE's, -A_i / (len_i * rows) per token.
    grad = jax.grad(lambda lp: policy_loss(lp, jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), cfg)[0])(
        jnp.asarray(logp))
    expected = -adv[:, None] / mask.sum(1, keepdims=True) / len(adv) * mask
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-8)


def test_gspo_with_token_level_epsilon_warns():
    with pytest.warns(UserWarning, match="GSPO"):
        GRPOConfig(ratio_level="sequence")


def test_clipped_tokens_get_zero_gradient():
    cfg = GRPOConfig(epsilon_low=0.2, epsilon_high=0.28)
    old = jnp.zeros((2, 4))
    # row 0: A > 0 with ratios 1.5 (clipped) and 1.1 (not); row 1: A < 0 with ratios 0.5 (clipped) and 0.9 (not)
    logp = jnp.log(jnp.array([[1.5, 1.1, 1.5, 1.1], [0.5, 0.9, 0.5, 0.9]]))
    adv = jnp.array([1.0, -1.0])
    grad = np.asarray(jax.grad(lambda lp: policy_loss(lp, old, adv, jnp.ones((2, 4)), cfg)[0])(logp))
    assert (grad[:, 0::2] == 0).all()
    assert (grad[:, 1::2] != 0).all()


def test_equal_rewards_with_beta_zero_give_exactly_zero_gradient():
    logp, old, _, mask, _ = batch(2, lengths=(5, 9, 2, 7))
    adv = group_advantages(jnp.full((4,), 0.1), 4)
    for cfg in CONFIGS[:3]:
        grad = jax.grad(lambda lp: policy_loss(lp, jnp.asarray(old), adv.advantages, jnp.asarray(mask), cfg,
                                               valid=adv.valid)[0])(jnp.asarray(logp))
        assert (np.asarray(grad) == 0).all()


def test_dropped_and_truncated_rows_do_not_contribute():
    logp, old, _, mask, adv = batch(3)
    cfg = GRPOConfig(mask_truncated=True)
    valid = jnp.array([True, False, True, True])
    truncated = jnp.array([False, False, True, False])
    grad = np.asarray(jax.grad(lambda lp: policy_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg,
                                                      valid=valid, truncated=truncated)[0])(jnp.asarray(logp)))
    assert (grad[1] == 0).all() and (grad[2] == 0).all() and (grad[3] != 0).any()
    with pytest.raises(ValueError, match="truncated"):
        policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg)


@pytest.mark.parametrize("changes,match", [
    (dict(epsilon_low=0.3, epsilon_high=0.2), "epsilon_high=0.2 < epsilon_low=0.3"),
    (dict(loss_agg="mean"), "loss_agg='mean'"),
    (dict(kl_estimator="k4"), "kl_estimator='k4'"),
    (dict(dual_clip=1.0), "dual_clip must be > 1"),
    (dict(loss_agg="seq_mean_token_sum_norm"), "max_completion_length"),
    (dict(beta=-0.1), "beta must be >= 0"),
    (dict(num_iterations=0), "num_iterations"),
    (dict(advantage_scale="std"), "advantage_scale='std'"),
    (dict(policy_loss="ppo"), "policy_loss='ppo'"),
    (dict(policy_loss="cispo", cispo_max_ratio=0.5), "cispo_max_ratio must be >= 1"),
    (dict(cispo_max_ratio=2.0), "set grpo.policy_loss: cispo too"),
    (dict(std_ddof=2), "std_ddof must be 0"),
])
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(GRPOConfig(), **changes)


def test_beta_needs_reference_logprobs():
    logp, old, _, mask, adv = batch()
    with pytest.raises(ValueError, match="reference log-probs"):
        policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), GRPOConfig(beta=0.1))


def test_entropy_bonus_subtracts_the_aggregated_entropy():
    logp, old, _, mask, adv = batch(4)
    entropy = np.random.default_rng(5).uniform(0, 3, logp.shape).astype(np.float32)
    args = (jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask))
    base, _ = policy_loss(*args, GRPOConfig())
    with_bonus, _ = policy_loss(*args, GRPOConfig(entropy_coef=0.01), entropy=jnp.asarray(entropy))
    expected = float(base) - 0.01 * (entropy * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(with_bonus), expected, rtol=1e-5)
    with pytest.raises(ValueError, match="entropies"):
        policy_loss(*args, GRPOConfig(entropy_coef=0.01))


def test_run_config_rejects_groups_of_one_and_a_short_dr_grpo_constant():
    with pytest.raises(ValueError, match="group_size=1"):
        RunConfig(sampling=SamplingConfig(group_size=1))
    with pytest.raises(ValueError, match="max_completion_length=64 is below sampling.max_new_tokens=128"):
        RunConfig(sampling=SamplingConfig(max_new_tokens=128),
                  grpo=GRPOConfig(loss_agg="seq_mean_token_sum_norm", max_completion_length=64))
    RunConfig(sampling=SamplingConfig(group_size=2, max_new_tokens=64),
              grpo=GRPOConfig(loss_agg="seq_mean_token_sum_norm", max_completion_length=64))
