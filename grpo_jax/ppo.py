"""The critic baseline's math (issue 15, in progress): generalised advantage estimation.

`gae(rewards, values, mask, gamma, lam)` over completion tokens: rewards [B, T] (a sequence's
verifiable reward sits on its last token), values [B, T] (the critic's estimate at each token),
mask [B, T] (1 on the completion's tokens, right-padded). A position after the last real token is
terminal: its value is 0 and nothing flows back from it.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[jax.Array, jax.Array]:
    """(advantages [B, T], returns [B, T]) float32, both 0 where `mask` is 0.

    delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
    A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}, returns_t = A_t + V_t (Schulman et al., 2016),
    computed right to left by one `lax.scan` over T (jit-friendly, no Python loop).
    """
    chex.assert_rank(rewards, 2)
    chex.assert_equal_shape([rewards, values, mask])
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae needs gamma and lam in [0, 1], got gamma={gamma}, lam={lam}")
    m = mask.astype(jnp.float32)
    r = rewards.astype(jnp.float32) * m
    v = values.astype(jnp.float32) * m
    # Next-token values and masks (0 past the end): the bootstrap target of each position.
    v_next = jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], axis=1)
    m_next = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
    delta = r + gamma * v_next * m_next - v

    def back(carry_B, xs):
        delta_B, m_next_B, m_B = xs
        adv_B = (delta_B + gamma * lam * m_next_B * carry_B) * m_B
        return adv_B, adv_B

    _, adv_TB = jax.lax.scan(back, jnp.zeros_like(r[:, 0]), (delta.T, m_next.T, m.T), reverse=True)
    advantages = adv_TB.T
    return advantages, (advantages + v) * m
