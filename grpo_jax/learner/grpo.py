"""GRPO math as pure jnp functions: group advantages and KL estimators.

Rewards come laid out as the sampler returns rows: row i*G + j is sample j of prompt i. A NaN
reward means the reward function returned None for that sample: the sample is dropped (advantage 0,
`valid` False) and the rest of its group is normalised without it.

Shape suffixes: see grpo_jax.shapes (R = N*G rows, N prompts, G group size, M completion tokens).
"""

from __future__ import annotations

import chex
import flax.struct
import jax
import jax.numpy as jnp

from grpo_jax.config import ESTIMATORS, KL_ESTIMATORS, SCALES, Estimator, Scale
from grpo_jax.groups import uniform_groups


@flax.struct.dataclass
class GroupAdvantages:
    advantages: jax.Array  # float32 [R]; exactly 0 for dropped samples and zero-variance groups
    valid: jax.Array  # bool [R]; False where the reward was NaN
    zero_std: jax.Array  # bool [N]; the group's valid rewards are all equal (or fewer than 2 are valid)


def group_advantages(rewards: jax.Array, group_size: int, *, scale: Scale = "group",
                     estimator: Estimator = "grpo", eps: float = 1e-6, ddof: int = 0) -> GroupAdvantages:
    """Advantages of each sample relative to its group.

    rewards: float [N*G], row i*G + j = sample j of prompt i, NaN = dropped. Pure jnp: under jit on
    a global (sharded) array, `scale="batch"` uses the std of the whole batch on every host.
    estimator: "grpo" centres on the group mean; "rloo" on the mean of the *other* valid samples of
    the group (leave-one-out), i.e. n/(n-1) times the grpo centring for n valid samples.
    scale: "group" divides by the group's standard deviation (of its valid rewards; `ddof` 0: the
    population std, 1: Bessel-corrected, as TRL) plus eps, as in GRPO; "batch" by the std of all
    valid rewards in the batch plus eps; "none" does not divide (Dr. GRPO).
    A group whose valid rewards are all equal gets advantage exactly 0 (not eps-sized noise), as
    does a group with fewer than 2 valid samples: it carries no signal.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}; choose one of {list(SCALES)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}; choose one of {list(ESTIMATORS)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof}")
    chex.assert_rank(rewards, 1)
    R = rewards.shape[0]
    if R % group_size:
        raise ValueError(f"{R} rewards do not split into groups of {group_size}")
    r_NG = rewards.astype(jnp.float32).reshape(-1, group_size)
    valid_NG = ~jnp.isnan(r_NG)
    r0_NG = jnp.where(valid_NG, r_NG, 0.0)
    n_N1 = valid_NG.sum(axis=1, keepdims=True).astype(jnp.float32)
    mean_N1 = r0_NG.sum(axis=1, keepdims=True) / jnp.maximum(n_N1, 1.0)
    centred_NG = jnp.where(valid_NG, r_NG - mean_N1, 0.0)
    zero_std_N = uniform_groups(rewards, group_size)
    if estimator == "rloo":
        centred_NG = centred_NG * (n_N1 / jnp.maximum(n_N1 - 1.0, 1.0))
    if scale == "group":
        std_N1 = jnp.sqrt(jnp.sum(jnp.where(valid_NG, (r_NG - mean_N1) ** 2, 0.0), axis=1, keepdims=True)
                          / jnp.maximum(n_N1 - ddof, 1.0))
        centred_NG = centred_NG / (std_N1 + eps)
    elif scale == "batch":
        n_all = jnp.maximum(valid_NG.sum(), 1)
        mean_all = r0_NG.sum() / n_all
        std_all = jnp.sqrt(jnp.sum(jnp.where(valid_NG, (r_NG - mean_all) ** 2, 0.0)) / jnp.maximum(n_all - ddof, 1))
        centred_NG = centred_NG / (std_all + eps)
    adv_NG = jnp.where(zero_std_N[:, None] | ~valid_NG, 0.0, centred_NG)
    return GroupAdvantages(advantages=adv_NG.reshape(R), valid=valid_NG.reshape(R), zero_std=zero_std_N)



def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from log-probs of tokens sampled from the policy.

    k1 = log p - log q (unbiased, can be negative); k2 = (log p - log q)^2 / 2 (biased, >= 0);
    k3 = q/p - 1 - log(q/p) (unbiased, >= 0; Schulman's estimator, used by GRPO).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator={estimator!r}; choose one of {list(KL_ESTIMATORS)}")
    chex.assert_equal_shape([logprobs, ref_logprobs])
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return jnp.expm1(-log_ratio) + log_ratio


def _token_objective(ratio_RM, adv_RM, config):
    """Clipped surrogate (to maximise) per token; ratio may be a token or a broadcast sequence ratio."""
    unclipped = ratio_RM * adv_RM
    clipped = jnp.clip(ratio_RM, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high) * adv_RM
    objective = jnp.minimum(unclipped, clipped)
    if config.dual_clip is not None:
        objective = jnp.where(adv_RM < 0, jnp.maximum(objective, config.dual_clip * adv_RM), objective)
    return objective


def token_ratio(logprobs, old_logprobs, mask):
    """GRPO/DAPO: one importance ratio per token."""
    del mask
    return jnp.exp(logprobs - old_logprobs)


def sequence_ratio(logprobs, old_logprobs, mask):
    """GSPO-token: every token carries its sequence's length-normalised ratio as its value, with the
    gradient of its own log-prob, so the aggregated gradient is GSPO's sequence-level gradient."""
    length_R1 = jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    seq_log_ratio_R1 = jnp.sum((logprobs - old_logprobs) * mask, axis=1, keepdims=True) / length_R1
    return jnp.exp(jax.lax.stop_gradient(seq_log_ratio_R1) + logprobs - jax.lax.stop_gradient(logprobs))


def loss_weights(mask: jax.Array, config) -> tuple[jax.Array, jax.Array]:
    """(per-token weights [R, M], normaliser) such that loss = sum(weights * per_token) / normaliser.

    Splitting a batch into micro-batches and summing sum(w * l) / normaliser over them, with the
    normaliser of the *whole* batch, gives exactly the whole batch's loss.
    """
    mask = mask.astype(jnp.float32)
    if config.loss_agg == "token_mean":
        return mask, jnp.maximum(mask.sum(), 1.0)
    if config.loss_agg == "seq_mean_token_mean":
        rows_with_tokens = jnp.maximum(jnp.sum(mask.sum(axis=1) > 0), 1).astype(jnp.float32)
        return mask / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0), rows_with_tokens
    # Dr. GRPO: a constant, every row of the batch (dropped and truncated ones too) x L_max.
    return mask, jnp.float32(mask.shape[0] * config.max_completion_length)


def effective_mask(mask: jax.Array, config, *, valid: jax.Array | None = None,
                   truncated: jax.Array | None = None) -> jax.Array:
    """float32 [R, M]: the tokens that enter the loss: completion tokens (`mask` [R, M]) of valid
    (`valid` [R]) and, with mask_truncated, non-truncated (`truncated` [R]) rows."""
    out = mask.astype(jnp.float32)
    if valid is not None:
        out = out * valid[:, None]
    if config.mask_truncated:
        if truncated is None:
            raise ValueError("grpo.mask_truncated needs the rollout's `truncated` flags")
        out = out * (~truncated.astype(jnp.bool_))[:, None]
    return out


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
                config, *, valid: jax.Array | None = None, truncated: jax.Array | None = None,
                ref_logprobs: jax.Array | None = None, entropy: jax.Array | None = None,
                normaliser: jax.Array | None = None,
                sampler_logprobs: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss (to minimise) and token statistics as sums (see `loss_metrics`).

    Shapes (grpo_jax.shapes): `logprobs`, `old_logprobs`, `ref_logprobs`, `sampler_logprobs`,
    `entropy` and `mask` float/int [R, M]; `advantages` [R] (GRPO: one per row) or [R, M] (PPO's
    GAE: one per token); `valid`, `truncated` bool [R].

    logprobs / old_logprobs / ref_logprobs: per-token log-probs of the sampled completion tokens
    under the current, sampling-time and reference policies. Rows with `valid` False (dropped
    rewards) and, with `config.mask_truncated`, truncated rows contribute nothing. `beta > 0` needs
    ref_logprobs; `entropy_coef > 0` needs entropy. `normaliser` (from `loss_weights` of the whole
    batch) is given when this is one micro-batch of a larger batch.

    sampler_logprobs: the sampler's own log-probs of the tokens. Their distance to `logprobs` is
    summed (`health/sampler_train_logprob_diff`, and its max), and with `config.sampler_is_cap` or
    `config.sampler_is_mask` each token's surrogate is weighted by `sampler_weights` (truncated or
    masked importance sampling, per token or per sequence, without gradient through the weight).
    """
    chex.assert_equal_shape([logprobs, old_logprobs, mask])
    if advantages.ndim == 2:
        chex.assert_equal_shape([advantages, logprobs])
    else:
        chex.assert_shape(advantages, (logprobs.shape[0],))
    mask_RM = effective_mask(mask, config, valid=valid, truncated=truncated)
    ratio_fn = sequence_ratio if config.ratio_level == "sequence" else token_ratio
    ratio_RM = ratio_fn(logprobs, old_logprobs, mask_RM)
    if advantages.ndim == 2:
        adv_RM = jnp.where(mask_RM > 0, advantages.astype(jnp.float32), 0.0)
    else:  # one per row, the same for each of its tokens
        adv_R1 = jnp.where(mask_RM.sum(axis=1, keepdims=True) > 0, advantages.astype(jnp.float32)[:, None], 0.0)
        adv_RM = jnp.broadcast_to(adv_R1, mask_RM.shape)
    if config.policy_loss == "cispo":  # REINFORCE with a clipped, stop-gradient importance weight
        weight_RM = jax.lax.stop_gradient(jnp.minimum(ratio_RM, config.cispo_bound))
        per_token_RM = -weight_RM * adv_RM * logprobs
    else:
        per_token_RM = -_token_objective(ratio_RM, adv_RM, config)
    per_token_RM, sums = _regularised(per_token_RM, logprobs, mask_RM, config, ref_logprobs=ref_logprobs,
                                      entropy=entropy, sampler_logprobs=sampler_logprobs, ratio_RM=ratio_RM)
    weights, local_normaliser = loss_weights(mask_RM, config)
    loss = jnp.sum(per_token_RM * weights) / (local_normaliser if normaliser is None else normaliser)
    r = jax.lax.stop_gradient(ratio_RM)
    sums["policy/clip_frac_low"] = jnp.sum(((r < 1 - config.epsilon_low) & (adv_RM < 0)) * mask_RM)
    sums["policy/clip_frac_high"] = jnp.sum(((r > 1 + config.epsilon_high) & (adv_RM > 0)) * mask_RM)
    sums["policy/ratio_max"] = jnp.max(jnp.where(mask_RM > 0, r, 0.0))
    return loss, sums


def _regularised(per_token_RM, logp_RM, mask_RM, config, *, ref_logprobs, entropy, sampler_logprobs, ratio_RM):
    """The surrogate with truncated importance sampling, the KL penalty and the entropy bonus
    applied -> (per-token loss [R, M], the statistics' sums so far)."""
    sums = {"tokens": mask_RM.sum()}
    if sampler_logprobs is not None:
        chex.assert_equal_shape([sampler_logprobs, logp_RM])
        log_w = jax.lax.stop_gradient(logp_RM) - sampler_logprobs
        sums["health/sampler_train_logprob_diff"] = jnp.sum(jnp.abs(log_w) * mask_RM)
        sums["health/sampler_train_logprob_diff_max"] = jnp.max(jnp.where(mask_RM > 0, jnp.abs(log_w), 0.0))
        weight_RM = sampler_weights(log_w, mask_RM, config)
        if weight_RM is not None:
            per_token_RM = per_token_RM * weight_RM
            sums["rollout/is_weight_mean"] = jnp.sum(weight_RM * mask_RM)
            sums["rollout/is_masked_frac"] = jnp.sum((weight_RM == 0) * mask_RM)
    elif config.sampler_is_cap is not None or config.sampler_is_mask is not None:
        raise ValueError("grpo.sampler_is_cap and grpo.sampler_is_mask need the sampler's log-probs")
    if config.beta > 0:
        if ref_logprobs is None:
            raise ValueError("grpo.beta > 0 needs reference log-probs")
        kl_RM = kl_estimate(logp_RM, ref_logprobs, config.kl_estimator)
        if config.kl_importance_weighted:  # TRL's use_bias_correction_kl
            kl_RM = kl_RM * ratio_RM
        per_token_RM = per_token_RM + config.beta * kl_RM
        for est in ("k1", "k3"):
            sums[f"kl/{est}"] = jnp.sum(jax.lax.stop_gradient(kl_estimate(logp_RM, ref_logprobs, est)) * mask_RM)
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("grpo.entropy_coef > 0 needs per-token entropies")
        per_token_RM = per_token_RM - config.entropy_coef * entropy
    if entropy is not None:
        sums["policy/entropy"] = jnp.sum(jax.lax.stop_gradient(entropy) * mask_RM)
    return per_token_RM, sums


def sampler_weights(log_w_RM: jax.Array, mask_RM: jax.Array, config) -> jax.Array | None:
    """Importance weights [R, M] of the trainer's policy against the sampler's, from the log-ratio
    of each sampled token (`log_w` = trainer - sampler), or None when neither correction is on.

    The weight is the token's ratio exp(log_w) (`sampler_is_level: token`) or, for every token of a
    row, the geometric mean of its tokens' ratios exp(mean of log_w over the row's loss tokens)
    (`sequence`); `sampler_is_cap` truncates it, min(w, cap); `sampler_is_mask` [low, high] sets it
    to 0 where the uncapped w falls outside (a whole row at sequence level)."""
    cap, bounds = config.sampler_is_cap, config.sampler_is_mask
    if cap is None and bounds is None:
        return None
    if config.sampler_is_level == "sequence":
        n_R1 = jnp.maximum(mask_RM.sum(axis=1, keepdims=True), 1.0)
        log_w_RM = jnp.broadcast_to((log_w_RM * mask_RM).sum(axis=1, keepdims=True) / n_R1, log_w_RM.shape)
    w_RM = jnp.exp(log_w_RM)
    weight_RM = w_RM if cap is None else jnp.minimum(w_RM, cap)
    if bounds is not None:
        weight_RM = jnp.where((w_RM >= bounds[0]) & (w_RM <= bounds[1]), weight_RM, 0.0)
    return jax.lax.stop_gradient(weight_RM)


MAX_SUMS = ("policy/ratio_max", "health/sampler_train_logprob_diff_max")  # maxima, not sums


def accumulate_sums(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Two micro-batches' `policy_loss` sums put together (MAX_SUMS by their maximum)."""
    return {k: (jnp.maximum(a[k], b[k]) if k in MAX_SUMS else a[k] + b[k]) for k in a}


def loss_metrics(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-token means from the sums of `policy_loss` (accumulated over micro-batches; MAX_SUMS are maxima)."""
    n = jnp.maximum(sums["tokens"], 1.0)
    return {k: (v if k in MAX_SUMS else v / n) for k, v in sums.items() if k != "tokens"}
