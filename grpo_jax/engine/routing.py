"""What a mixture-of-experts model's routers did while sampling: the experts each fed token went to,
recorded inside the engines' jitted loops for the learner to replay (models.moe, `moe.routing_replay`).

A completion token t is routed when it is fed to the model (the step that draws token t + 1), so
its experts are those of that decode step; a token never fed (a sequence's last) keeps 0. Every
engine writes one [.., M, L, Kx] buffer of the smallest integer dtype that holds an expert id
(`moe.expert_dtype`: uint8 up to 256 experts) once per step, at each feeding slot's sequence and
position: one scatter of [slots, L, Kx] per step, no host round trip. A dense model has no buffer
(None) and its programs are unchanged.

Shape letters: grpo_jax.shapes (Z row shards, J slots, Rb sequences per shard, M tokens, L layers;
Kx experts per token, models.moe).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.models.moe import expert_dtype


def expert_buffer(cfg, shape: tuple[int, ...]) -> jax.Array | None:
    """Zeros [*shape, L, Kx] in the expert-id dtype for a mixture-of-experts `cfg` (a
    TransformerConfig); None for a dense model."""
    if not cfg.is_moe:
        return None
    return jnp.zeros((*shape, cfg.num_layers, cfg.num_experts_per_tok), expert_dtype(cfg.num_experts))


def stored(experts: jax.Array | None, cfg) -> jax.Array | None:
    """A pass's experts (int32 [..., L, Kx]) in the dtype a rollout stores them in (None stays None)."""
    return None if experts is None else experts.astype(expert_dtype(cfg.num_experts))


def layer_experts(routed: list, shape: tuple[int, ...]) -> jax.Array | None:
    """Each layer's `moe.Routing` of one token per slot (experts [X, Kx]) -> int32 [*shape, L, Kx]
    (X = the product of `shape`); None for a dense model's layers (None each)."""
    if routed[0] is None:
        return None
    return jnp.stack([r.experts for r in routed], axis=1).reshape(*shape, len(routed), -1)


def record(buf_ZRMLK: jax.Array | None, experts_ZJLK: jax.Array | None, seq_ZJ: jax.Array, t_ZJ: jax.Array,
           fed_ZJ: jax.Array) -> jax.Array | None:
    """The buffer [Z, Rb, M, L, Kx] with the `fed_ZJ` slots' experts [Z, J, L, Kx] written at their
    sequence `seq_ZJ` (shard-local) and position `t_ZJ`; the other slots' writes are dropped."""
    if buf_ZRMLK is None:
        return None
    Z, Rb = buf_ZRMLK.shape[:2]
    z_Z1 = jnp.arange(Z, dtype=jnp.int32)[:, None]
    at_ZJ = jnp.where(fed_ZJ, seq_ZJ, Rb)
    return buf_ZRMLK.at[z_Z1, at_ZJ, t_ZJ].set(experts_ZJLK.astype(buf_ZRMLK.dtype), mode="drop")


def fed_only(experts_RMLK: jax.Array | None, lengths_R: jax.Array) -> jax.Array | None:
    """Experts [R, M, L, Kx] with the positions no sequence fed set to 0: a sequence of n tokens fed
    its first n - 1 (its last ends it). Whatever a sequence recorded past its end before it was
    preempted and drew a shorter one (the paged engine's recompute) is cleared."""
    if experts_RMLK is None:
        return None
    M = experts_RMLK.shape[1]
    fed_RM = jnp.arange(M)[None] < lengths_R[:, None] - 1
    return jnp.where(fed_RM[..., None, None], experts_RMLK, 0).astype(experts_RMLK.dtype)
