"""Health metrics (issue 15): the gradient noise scale against NumPy on per-micro-batch gradients
computed independently, the expected dead-group fraction against its formula, sampler/trainer
log-prob drift and truncated importance sampling, the host-side rollout statistics, the random
reward control."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from batches import M, R, fresh, make_batch, one_device_step

from grpo_jax.config import GRPOConfig
from grpo_jax.learner.grpo import effective_mask, loss_metrics, loss_weights, policy_loss
from grpo_jax.rollout.health import distinct_answers, expected_zero_std_fraction, random_control, rollout_health
from grpo_jax.learner.logprobs import completion_logprobs
from grpo_jax.rewards import RewardResult, RewardSpec, format_reward
from grpo_jax.learner.micro_batches import grad_noise_scale


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def test_grad_noise_scale_of_the_step_equals_numpy_on_micro_batch_gradients():
    """One step: the gradient noise scale against NumPy on the four micro-batch gradients computed
    on their own, and the sampler/trainer drift against the shift given to the sampler's log-probs."""
    cfg, k = GRPOConfig(), 4
    batch = make_batch(seed=3, rewards=[1, 0, 0, 1, 0, 1, 1, 1])
    opt = optax.sgd(0.0)
    graphdef, state = fresh(opt)
    logp, _ = completion_logprobs(nnx.merge(graphdef, state.params), batch.prompt_ids, batch.prompt_mask,
                                  batch.completion_ids, chunk=2)
    # At mu = 1 the loss uses the trainer's own log-probs: the sampler's only enter the drift.
    batch = batch.replace(old_logprobs=logp + 0.25 * batch.completion_mask)
    # Each micro-batch's gradient on its own: its rows' loss under the whole batch's normaliser.
    _, normaliser = loss_weights(effective_mask(batch.completion_mask, cfg, valid=batch.valid,
                                                truncated=batch.truncated), cfg)
    b = R // k

    def piece_loss(params, rows):  # rows: int [b], the micro-batch's row indices
        mb = jax.tree.map(lambda x: x[rows], batch.replace(zero_std=None))
        logp, _ = completion_logprobs(nnx.merge(graphdef, params), mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                      chunk=2)
        return policy_loss(logp, jax.lax.stop_gradient(logp), mb.advantages, mb.completion_mask, cfg,
                           valid=mb.valid, truncated=mb.truncated, normaliser=normaliser)[0]

    piece_grad = jax.jit(jax.grad(piece_loss))  # one compile for the k pieces
    # Micro-batch i holds every k-th row from row i (micro_batches.split_micro_batches).
    pieces = [_flat(piece_grad(state.params, jnp.arange(i, R, k))) for i in range(k)]
    g = np.sum(pieces, axis=0)
    estimates = [k * p for p in pieces]  # each piece's estimate of the whole gradient, from b rows
    trace = b * sum(np.sum((e - g) ** 2) for e in estimates) / (k - 1)
    expected = trace / np.sum(g**2)

    step = one_device_step(graphdef, opt, cfg, state, micro_batches=k, logprob_chunk=2)
    _, metrics = step(state, batch)
    assert expected > 0.1
    np.testing.assert_allclose(float(metrics["health/grad_noise_scale"]), expected, rtol=2e-4)
    np.testing.assert_allclose(float(metrics["train/grad_norm"]), np.sqrt(np.sum(g**2)), rtol=1e-5)
    assert float(metrics["health/sampler_train_logprob_diff"]) == pytest.approx(0.25, abs=1e-4)
    assert float(metrics["health/sampler_train_logprob_diff_max"]) == pytest.approx(0.25, abs=1e-4)


def test_grad_noise_scale_is_nan_with_one_piece_and_matches_the_formula():
    rng = np.random.default_rng(0)
    g_k = rng.normal(size=(5, 7))
    total = g_k.sum(0)
    got = grad_noise_scale(jnp.float32(np.sum(g_k**2)), jnp.float32(np.sum(total**2)), pieces=5, rows=40)
    ref = (40 / 5) / 4 * np.sum((5 * g_k - total) ** 2) / np.sum(total**2)
    np.testing.assert_allclose(float(got), ref, rtol=1e-5)
    assert np.isnan(float(grad_noise_scale(jnp.float32(1.0), jnp.float32(1.0), pieces=1, rows=8)))


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_expected_zero_std_fraction_is_the_formula(group_size):
    p = np.array([0.0, 0.1, 0.5, 0.75, 1.0])
    want = np.mean([q**group_size + (1 - q) ** group_size for q in p])
    assert expected_zero_std_fraction(pass_rates=p, group_size=group_size) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="pass rates"):
        expected_zero_std_fraction(pass_rates=[1.2], group_size=group_size)


def test_expected_matches_simulated_iid_groups():
    # Independent samples at a shared pass rate: the observed uniform share converges to the formula.
    rng = np.random.default_rng(1)
    p, G_ = 0.3, 4
    correct = rng.random((20000, G_)) < p
    observed = np.mean(correct.all(1) | ~correct.any(1))
    assert observed == pytest.approx(expected_zero_std_fraction([p], G_), abs=0.01)


def test_sampler_drift_sums_and_truncated_importance_weights():
    rng = np.random.default_rng(2)
    logp = rng.normal(-2, 0.5, (R, M)).astype(np.float32)
    sampler = (logp + rng.normal(0, 0.3, (R, M))).astype(np.float32)
    mask = (np.arange(M)[None] < rng.integers(1, M + 1, R)[:, None]).astype(np.float32)
    adv = rng.normal(size=R).astype(np.float32)
    for cap in (None, 1.5):
        cfg = GRPOConfig(sampler_is_cap=cap)
        loss, sums = policy_loss(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), cfg,
                                 sampler_logprobs=jnp.asarray(sampler))
        diff = np.abs(logp - sampler)
        np.testing.assert_allclose(float(sums["health/sampler_train_logprob_diff"]), (diff * mask).sum(), rtol=1e-5)
        np.testing.assert_allclose(float(sums["health/sampler_train_logprob_diff_max"]), diff[mask > 0].max(),
                                   rtol=1e-6)
        # mu = 1 (ratio 1, no clipping): the per-token loss is -A, weighted by min(p_train / p_sampler, cap).
        w = np.ones_like(logp) if cap is None else np.minimum(np.exp(logp - sampler), cap)
        want = np.sum(-adv[:, None] * w * mask) / mask.sum()
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    with pytest.raises(ValueError, match="sampler's log-probs"):
        policy_loss(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask),
                    GRPOConfig(sampler_is_cap=2.0))


def numpy_sampler_weights(logp, sampler, mask, cap, bounds, level):
    """The importance weights written out: per token, or the geometric mean of a row's ratios."""
    log_w = logp - sampler
    if level == "sequence":
        per_row = np.array([log_w[r][mask[r] > 0].mean() if mask[r].any() else 0.0 for r in range(len(mask))])
        log_w = np.repeat(per_row[:, None], mask.shape[1], axis=1)
    w = np.exp(log_w.astype(np.float64))
    weight = w if cap is None else np.minimum(w, cap)
    if bounds is not None:
        weight = np.where((w >= bounds[0]) & (w <= bounds[1]), weight, 0.0)
    return weight


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap, bounds", [(None, (0.95, 1.05)), (1.02, (0.9, 1.1)), (2.0, None)])
def test_masked_and_sequence_level_importance_weights_against_numpy(level, cap, bounds):
    """grpo.sampler_is_mask drops the tokens (sequence level: the rows) whose ratio to the sampler
    falls outside [low, high] and keeps the others' weight; the loss, is_weight_mean and
    is_masked_frac agree with the NumPy reference, and the KL term is not weighted."""
    rng = np.random.default_rng(3)
    logp = rng.normal(-2, 0.5, (R, M)).astype(np.float32)
    sampler = (logp + rng.normal(0, 0.25, (R, M))).astype(np.float32)
    mask = (np.arange(M)[None] < rng.integers(1, M + 1, R)[:, None]).astype(np.float32)
    adv = rng.normal(size=R).astype(np.float32)
    cfg = GRPOConfig(sampler_is_cap=cap, sampler_is_mask=bounds, sampler_is_level=level, beta=0.1)
    ref = logp - 0.2
    loss, sums = policy_loss(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), cfg,
                             ref_logprobs=jnp.asarray(ref), sampler_logprobs=jnp.asarray(sampler))
    weight = numpy_sampler_weights(logp, sampler, mask, cap, bounds, level)
    k3 = np.exp(ref - logp) - (ref - logp) - 1
    want = np.sum((-adv[:, None] * weight + 0.1 * k3) * mask) / mask.sum()  # mu = 1: the ratio is 1
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7)
    metrics = loss_metrics(sums)
    np.testing.assert_allclose(float(metrics["rollout/is_weight_mean"]), (weight * mask).sum() / mask.sum(), rtol=1e-5)
    masked = ((weight == 0) * mask).sum() / mask.sum()
    assert float(metrics["rollout/is_masked_frac"]) == pytest.approx(masked, abs=1e-6)
    if bounds is not None:
        assert 0 < masked < 1  # the draw puts some tokens (rows) on each side
        if level == "sequence":  # whole rows: a row's loss tokens are all kept or all dropped
            kept = [set((weight[r] > 0)[mask[r] > 0]) for r in range(R)]
            assert all(len(k) == 1 for k in kept)


def test_rollout_health_counts_what_it_says():
    G_ = 4
    texts = ["#### 5", "#### 5", "#### 5", "#### 6",  # group 0: 2 distinct answers, 3 of 4 correct
             "no answer", "no  answer", "#### 1", "#### 2",  # group 1: 3 distinct (whitespace ignored), 0 correct
             "#### 3", "#### 3", "#### 3", "#### 3"]  # group 2: all correct
    acc = np.array([1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, np.nan], np.float32)  # the last one unjudged
    fmt = np.array([0.5] * 12, np.float32)
    lengths = np.arange(1, 13, dtype=np.int32)
    result = RewardResult(total=acc + fmt, per_fn={"math_accuracy": acc, "format": fmt}, failures={}, messages={})
    specs = [RewardSpec("math_accuracy", lambda *a, **k: [], 1.0), RewardSpec("format", format_reward, 0.5)]
    distinct = distinct_answers(texts, G_)
    np.testing.assert_array_equal(distinct, [2, 3, 1])
    out, rates = rollout_health(result, distinct, lengths, group_size=G_, correct_by="math_accuracy", specs=specs)
    np.testing.assert_allclose(rates, [0.75, 0.0, 1.0])
    p = 6 / 11
    assert out["health/pass_rate"] == pytest.approx(p)
    assert out["health/frac_zero_std_expected"] == pytest.approx(p**4 + (1 - p) ** 4)
    assert out["groups/frac_all_correct"] == pytest.approx(1 / 3)
    assert out["groups/frac_all_wrong"] == pytest.approx(1 / 3)
    assert out["health/distinct_answers"] == pytest.approx(2.0)
    assert out["completion/len_correct"] == pytest.approx(np.mean([1, 2, 3, 9, 10, 11]))
    assert out["completion/len_incorrect"] == pytest.approx(np.mean([4, 5, 6, 7, 8]))
    # |0.5 x 0.5| per sample of format against |1 x acc|: 12 x 0.25 / (6 + 12 x 0.25).
    assert out["health/format_reward_share"] == pytest.approx(3.0 / 9.0)
    no_format, _ = rollout_health(result, distinct, lengths, group_size=G_, correct_by="math_accuracy",
                                  specs=specs[:1])
    assert "health/format_reward_share" not in no_format


def test_random_control_keeps_the_mean_and_the_dropped_samples():
    rewards = np.where(np.arange(4000) % 10 == 0, np.nan, (np.arange(4000) % 3 == 0)).astype(np.float32)
    mean = float(np.nanmean(rewards))
    flips = random_control(rewards, mean, np.random.default_rng(0))
    assert np.array_equal(np.isnan(flips), np.isnan(rewards))
    assert set(np.unique(flips[~np.isnan(flips)])) == {0.0, 1.0}
    assert np.nanmean(flips) == pytest.approx(mean, abs=0.03)
    # Unrelated to the rewards they replace.
    kept = ~np.isnan(rewards)
    assert abs(np.corrcoef(flips[kept], rewards[kept])[0, 1]) < 0.05
    again = random_control(rewards, mean, np.random.default_rng(0))
    np.testing.assert_array_equal(flips, again)
