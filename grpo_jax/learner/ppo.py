"""The critic baseline (`algorithm: ppo`): a value head, generalised advantage estimation and the
clipped value loss, as pure jnp functions used inside the train step.

`gae(rewards, values, mask, gamma, lam)` over completion tokens: rewards [B, T] (a sequence's
verifiable reward sits on its last token: `terminal_rewards`), values [B, T] (the critic's
estimate of the state before each token), mask [B, T] (1 on the completion's tokens,
right-padded). A position after the last real token is terminal: its value is 0 and nothing
flows back from it.

The critic (`critic_values`) is a linear head on the policy's final hidden states (`init_critic`,
`values`): one forward pass gives both the log-probs and the values, so PPO's update costs what
GRPO's does; or (`ppo.critic: model`) the head on a separate transformer's (grpo_jax.trainer.side_models).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config import GRPOConfig, PPOConfig
from grpo_jax.learner.grpo import effective_mask, loss_weights, policy_loss
from grpo_jax.learner.logprobs import completion_states


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0,
        lam: float | jax.Array = 0.95) -> tuple[jax.Array, jax.Array]:
    """(advantages [B, T], returns [B, T]) float32, both 0 where `mask` is 0.

    delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
    A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}, returns_t = A_t + V_t (Schulman et al., 2016),
    computed right to left by one `lax.scan` over T (jit-friendly, no Python loop). `lam`: one
    value, or one per sequence [B] (VAPO's length-adaptive lambda, `length_adaptive_lambda`).
    """
    chex.assert_rank(rewards, 2)
    chex.assert_equal_shape([rewards, values, mask])
    scalar = isinstance(lam, (int, float))
    if not 0.0 <= gamma <= 1.0 or (scalar and not 0.0 <= lam <= 1.0):
        raise ValueError(f"gae needs gamma and lam in [0, 1], got gamma={gamma}, lam={lam}")
    if not scalar:
        chex.assert_shape(lam, (rewards.shape[0],))
    lam_B = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (rewards.shape[0],))
    m = mask.astype(jnp.float32)
    r = rewards.astype(jnp.float32) * m
    v = values.astype(jnp.float32) * m
    # Next-token values and masks (0 past the end): the bootstrap target of each position.
    v_next = jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], axis=1)
    m_next = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
    delta = r + gamma * v_next * m_next - v

    def back(carry_B, xs):
        delta_B, m_next_B, m_B = xs
        adv_B = (delta_B + gamma * lam_B * m_next_B * carry_B) * m_B
        return adv_B, adv_B

    _, adv_TB = jax.lax.scan(back, jnp.zeros_like(r[:, 0]), (delta.T, m_next.T, m.T), reverse=True)
    advantages = adv_TB.T
    return advantages, (advantages + v) * m


def length_adaptive_lambda(mask: jax.Array, alpha: float) -> jax.Array:
    """VAPO's policy lambda per sequence [B]: 1 - 1 / (alpha * l) for a sequence of l tokens (in
    [0, 1]): long sequences bootstrap less, so their early tokens see more of the final reward."""
    length_B = jnp.maximum(mask.astype(jnp.float32).sum(axis=1), 1.0)
    return jnp.clip(1.0 - 1.0 / (alpha * length_B), 0.0, 1.0)


def init_critic(hidden_size: int) -> dict[str, jax.Array]:
    """The value head's parameters, zero (V = 0 until it learns): w float32 [E], b float32 []."""
    return {"w": jnp.zeros((hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def values(critic: dict[str, jax.Array], hidden: jax.Array) -> jax.Array:
    """float32 [R, M]: the value of each state (hidden states [R, M, E], e.g. `completion_states`)."""
    chex.assert_rank(hidden, 3)
    return jnp.einsum("rme,e->rm", hidden.astype(jnp.float32), critic["w"]) + critic["b"]


def terminal_rewards(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """float32 [R, M]: each row's reward (float [R]; NaN = dropped, taken as 0) on its last real token."""
    chex.assert_shape(rewards, (mask.shape[0],))
    m = mask.astype(jnp.int32)
    last_R = jnp.maximum(m.sum(axis=1) - 1, 0)
    at_last = jnp.arange(m.shape[1])[None, :] == last_R[:, None]
    r_R = jnp.nan_to_num(rewards.astype(jnp.float32), nan=0.0)
    return jnp.where(at_last & (m > 0), r_R[:, None], 0.0)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, clip: float) -> jax.Array:
    """Per-token clipped value loss [R, M] (PPO2): 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2)."""
    chex.assert_equal_shape([values, old_values, returns])
    clipped = old_values + jnp.clip(values - old_values, -clip, clip)
    return 0.5 * jnp.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def explained_variance(sums: dict[str, jax.Array]) -> jax.Array:
    """1 - Var(returns - values) / Var(returns) over the masked tokens, from the sums `n`, `ret`,
    `ret2`, `err`, `err2` (accumulated over micro-batches). NaN when the returns do not vary."""
    n = jnp.maximum(sums["n"], 1.0)
    var_ret = sums["ret2"] / n - (sums["ret"] / n) ** 2
    var_err = sums["err2"] / n - (sums["err"] / n) ** 2
    return jnp.where(var_ret > 1e-12, 1.0 - var_err / jnp.maximum(var_ret, 1e-12), jnp.nan)


def ppo_loss(v_RM: jax.Array, logprobs: jax.Array, old_logprobs: jax.Array, entropy: jax.Array, mb,
             config: GRPOConfig, ppo: PPOConfig, normaliser: jax.Array, *, warmup: jax.Array | bool = False,
             positive_tokens: jax.Array | float = 1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The PPO objective of one micro-batch `mb` (a train_step.Batch slice) from the critic's values
    `v_RM` [R, M] (`critic_values`) and the policy's log-probs (current and old) and entropies:
    GRPO's clipped surrogate on GAE's per-token advantages (from the values of the rollout's policy:
    these, without gradient, at mu = 1), plus `value_coef` x the clipped value loss, under the same
    token weights and normaliser, plus `positive_lm_coef` x the language-model loss of the rows with
    a positive reward (their token sum over the whole batch's `positive_tokens`).

    `warmup` (traced bool, VAPO's value pretraining): the value loss alone, on Monte-Carlo returns
    (lambda 1); the policy terms are 0 (the caller keeps the policy's parameters as they were).

    Returns (loss, sums): `policy_loss`'s sums, `value/loss`, `value/mean`, the `value/_*` sums of
    `explained_variance` and, with positive_lm_coef, `_train/positive_lm_loss` (already normalised)."""
    mask_RM = effective_mask(mb.completion_mask, config, valid=mb.valid, truncated=mb.truncated)
    old_v = jax.lax.stop_gradient(v_RM)
    rewards_RM = terminal_rewards(jnp.where(mb.valid, mb.rewards, 0.0), mb.completion_mask)
    rows = mb.completion_mask.shape[0]
    # Decoupled GAE (VAPO): the critic's targets with lam_critic (1.0: Monte Carlo returns), the
    # policy's advantages with lam_policy or, with length_adaptive_alpha, a lambda per sequence.
    lam_policy = ppo.lam_policy if ppo.length_adaptive_alpha is None else \
        length_adaptive_lambda(mb.completion_mask, ppo.length_adaptive_alpha)
    lam_critic = jnp.where(warmup, 1.0, jnp.full((rows,), ppo.lam_critic, jnp.float32))
    adv_RM, _ = gae(rewards_RM, old_v, mb.completion_mask, ppo.gamma, lam_policy)
    _, ret_RM = gae(rewards_RM, old_v, mb.completion_mask, ppo.gamma, lam_critic)
    loss, sums = policy_loss(logprobs, old_logprobs, adv_RM, mb.completion_mask, config, valid=mb.valid,
                             truncated=mb.truncated, ref_logprobs=mb.ref_logprobs, entropy=entropy,
                             normaliser=normaliser, sampler_logprobs=mb.old_logprobs)
    policy_terms, extra = loss, {}
    if ppo.positive_lm_coef:
        lm = -jnp.sum(logprobs * positive_mask(mb)) / jnp.maximum(positive_tokens, 1.0)
        policy_terms, extra = loss + ppo.positive_lm_coef * lm, {"_train/positive_lm_loss": jax.lax.stop_gradient(lm)}
    weights, _ = loss_weights(mask_RM, config)
    v_loss_RM = value_loss(v_RM, old_v, ret_RM, ppo.value_clip)
    loss = jnp.where(warmup, 0.0, policy_terms) + ppo.value_coef * jnp.sum(v_loss_RM * weights) / normaliser
    err = jax.lax.stop_gradient(ret_RM - v_RM)
    sums.update({"value/loss": jnp.sum(jax.lax.stop_gradient(v_loss_RM) * mask_RM),
                 "value/mean": jnp.sum(old_v * mask_RM), "value/_n": mask_RM.sum(),
                 "value/_ret": jnp.sum(ret_RM * mask_RM), "value/_ret2": jnp.sum(ret_RM**2 * mask_RM),
                 "value/_err": jnp.sum(err * mask_RM), "value/_err2": jnp.sum(err**2 * mask_RM), **extra})
    return loss, sums


def positive_mask(batch) -> jax.Array:
    """float32 [R, M]: the completion tokens of the valid rows with a reward > 0 (VAPO's positive
    examples: a verifier's correct answers), which `ppo.positive_lm_coef`'s loss imitates."""
    positive_R = batch.valid & (jnp.nan_to_num(batch.rewards, nan=0.0) > 0)
    return batch.completion_mask.astype(jnp.float32) * positive_R[:, None]


def critic_values(critic: dict, hidden: jax.Array, mb, *, critic_graphdef=None, warmup: jax.Array | bool = False,
                  group_size: int = 1, row_sharding=None) -> jax.Array:
    """float32 [R, M]: the critic's value of the state before each completion token of `mb`.
    `critic_graphdef` None (`ppo.critic: head`): the head on the policy's hidden states `hidden`
    [R, M, E], which during `warmup` get no gradient from it (the trunk is the policy's). Else
    (`ppo.critic: model`): the head on the critic model's own hidden states of the same tokens
    (`critic["model"]`, the parameters of the structure `critic_graphdef`)."""
    if critic_graphdef is None:
        if warmup is not False:  # traced: a run with a value warm-up
            hidden = jnp.where(warmup, jax.lax.stop_gradient(hidden), hidden)
        return values(critic, hidden)
    model = nnx.merge(critic_graphdef, critic["model"])
    own = completion_states(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, group_size=group_size,
                            row_sharding=row_sharding)
    return values(critic, own)
