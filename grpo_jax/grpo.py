"""GRPO math as pure jnp functions: group advantages and KL estimators.

Rewards come laid out as the sampler returns rows: row i*G + j is sample j of prompt i. A NaN
reward means the reward function returned None for that sample: the sample is dropped (advantage 0,
`valid` False) and the rest of its group is normalised without it.

Shape suffixes: R = N*G rows, N groups (prompts), G group size, M completion tokens.
"""

from __future__ import annotations

from typing import Literal

import chex
import flax.struct
import jax
import jax.numpy as jnp

Scale = Literal["group", "batch", "none"]
Estimator = Literal["grpo", "rloo"]
SCALES: tuple[str, ...] = ("group", "batch", "none")
ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


@flax.struct.dataclass
class GroupAdvantages:
    advantages: jax.Array  # float32 [R]; exactly 0 for dropped samples and zero-variance groups
    valid: jax.Array  # bool [R]; False where the reward was NaN
    zero_std: jax.Array  # bool [N]; the group's valid rewards are all equal (or fewer than 2 are valid)


def group_advantages(rewards_R: jax.Array, group_size: int, *, scale: Scale = "group",
                     estimator: Estimator = "grpo", eps: float = 1e-6) -> GroupAdvantages:
    """Advantages of each sample relative to its group.

    estimator: "grpo" centres on the group mean; "rloo" on the mean of the *other* valid samples of
    the group (leave-one-out), i.e. n/(n-1) times the grpo centring for n valid samples.
    scale: "group" divides by the group's standard deviation (population std of its valid rewards,
    ddof=0) plus eps, as in GRPO; "batch" by the std of all valid rewards in the batch plus eps;
    "none" does not divide (Dr. GRPO).
    A group whose valid rewards are all equal gets advantage exactly 0 (not eps-sized noise), as
    does a group with fewer than 2 valid samples: it carries no signal.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}; choose one of {list(SCALES)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}; choose one of {list(ESTIMATORS)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    chex.assert_rank(rewards_R, 1)
    R = rewards_R.shape[0]
    if R % group_size:
        raise ValueError(f"{R} rewards do not split into groups of {group_size}")
    r_NG = rewards_R.astype(jnp.float32).reshape(-1, group_size)
    valid_NG = ~jnp.isnan(r_NG)
    r0_NG = jnp.where(valid_NG, r_NG, 0.0)
    n_N1 = valid_NG.sum(axis=1, keepdims=True).astype(jnp.float32)
    mean_N1 = r0_NG.sum(axis=1, keepdims=True) / jnp.maximum(n_N1, 1.0)
    centred_NG = jnp.where(valid_NG, r_NG - mean_N1, 0.0)
    hi = jnp.where(valid_NG, r_NG, -jnp.inf).max(axis=1)
    lo = jnp.where(valid_NG, r_NG, jnp.inf).min(axis=1)
    zero_std_N = (n_N1[:, 0] < 2) | (hi == lo)
    if estimator == "rloo":
        centred_NG = centred_NG * (n_N1 / jnp.maximum(n_N1 - 1.0, 1.0))
    if scale == "group":
        std_N1 = jnp.sqrt(jnp.sum(jnp.where(valid_NG, (r_NG - mean_N1) ** 2, 0.0), axis=1, keepdims=True)
                          / jnp.maximum(n_N1, 1.0))
        centred_NG = centred_NG / (std_N1 + eps)
    elif scale == "batch":
        n_all = jnp.maximum(valid_NG.sum(), 1)
        mean_all = r0_NG.sum() / n_all
        std_all = jnp.sqrt(jnp.sum(jnp.where(valid_NG, (r_NG - mean_all) ** 2, 0.0)) / n_all)
        centred_NG = centred_NG / (std_all + eps)
    adv_NG = jnp.where(zero_std_N[:, None] | ~valid_NG, 0.0, centred_NG)
    return GroupAdvantages(advantages=adv_NG.reshape(R), valid=valid_NG.reshape(R), zero_std=zero_std_N)


def kl_estimate(logp_RM: jax.Array, ref_logp_RM: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from log-probs of tokens sampled from the policy.

    k1 = log p - log q (unbiased, can be negative); k2 = (log p - log q)^2 / 2 (biased, >= 0);
    k3 = q/p - 1 - log(q/p) (unbiased, >= 0; Schulman's estimator, used by GRPO).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator={estimator!r}; choose one of {list(KL_ESTIMATORS)}")
    chex.assert_equal_shape([logp_RM, ref_logp_RM])
    log_ratio = logp_RM - ref_logp_RM
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return jnp.expm1(-log_ratio) + log_ratio
