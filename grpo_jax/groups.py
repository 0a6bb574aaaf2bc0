"""What the actor side and the learner both read of a group of samples: which groups carry no
signal (`uniform_groups`: advantages, `groups/frac_zero_std`, dynamic sampling) and DAPO's soft
overlong penalty (`overlong_penalty`: the `overlong` reward). A leaf: nothing here imports another
part of the package, so the sampler, the rewards and the learner can all read it.

Shapes: grpo_jax.shapes (N prompts, G group size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def uniform_groups(rewards: jax.Array, group_size: int) -> jax.Array:
    """bool [N]: groups of `rewards` (float [N*G], NaN = dropped) that carry no signal: their valid
    rewards are all equal, or fewer than 2 are valid. The one definition of a zero-variance group,
    for advantages, `groups/frac_zero_std` and dynamic sampling alike (works on NumPy input too)."""
    r_NG = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    valid_NG = ~jnp.isnan(r_NG)
    hi = jnp.where(valid_NG, r_NG, -jnp.inf).max(axis=1)
    lo = jnp.where(valid_NG, r_NG, jnp.inf).min(axis=1)
    return (valid_NG.sum(axis=1) < 2) | (hi == lo)


def overlong_penalty(lengths: jax.Array, max_length: int, cache_length: int) -> jax.Array:
    """DAPO's soft overlong punishment, in tokens, added to the reward.

    0 up to max_length - cache_length tokens, then falling linearly to -1 at max_length, and -1
    beyond it.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"overlong penalty needs 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    over = lengths.astype(jnp.float32) - (max_length - cache_length)
    return jnp.where(lengths > max_length, -1.0, -jnp.clip(over, 0.0, None) / cache_length)
