"""Mixture-of-experts layers (Qwen3-MoE): the router, routing replay, and what a pass's routers did.

A token's MLP is the weighted sum of its top-k experts' gated MLPs (`models.experts.expert_mlp`
computes them). The router is one linear map to expert logits (in the compute dtype, as HF); its
softmax is taken in float32, the top `num_experts_per_tok` experts are chosen, and with
`norm_topk_prob` their weights are renormalised to sum to 1.

Routing replay: a pass given `replay` (the experts the sampler chose for each token) sends each
token to those experts instead of its router's own top-k (a slot holding one id Kx times, as the
engines leave a token they never fed, routes by the router); the weights are still the router's
current softmax at those experts (renormalised over them), so they stay differentiable. With
`norm_topk_prob` a replayed token's weights depend only on the logits of the replayed experts.
`Routing.mismatch` counts the tokens whose router would have chosen another set.

Shapes (grpo_jax.shapes, plus): Ex experts, Kx experts per token (top-k), Fx an expert's MLP width.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from grpo_jax.models.config import TransformerConfig
from grpo_jax.models.experts import expert_mlp, tokens_per_expert


@flax.struct.dataclass
class Routing:
    """What the routers of one pass did, per layer (a scan stacks them on a leading L axis).

    `experts` int32 [B, T, L, Kx]: the experts each token went to (replayed, or the router's own
    top-k), in the layout a rollout stores and `replay` takes. The rest count real tokens only
    (padding is routed too but not counted): `counts` float32 [L, Ex] (token, choice) pairs per
    expert; `prob_sums` float32 [L, Ex] the router's softmax summed over tokens; `tokens` float32
    [L]; `mismatch` float32 [L] tokens whose router's own top-k set differs from the experts used
    (0 without replay).
    """

    experts: jax.Array
    counts: jax.Array
    prob_sums: jax.Array
    tokens: jax.Array
    mismatch: jax.Array


def expert_dtype(num_experts: int):
    """The smallest integer dtype that holds expert ids: what a rollout stores them in."""
    return jnp.uint8 if num_experts <= 256 else jnp.int16 if num_experts <= 32768 else jnp.int32


def route(h_XE: jax.Array, router_EEx: jax.Array, cfg: TransformerConfig, *, replay_XK: jax.Array | None = None,
          real_X: jax.Array | None = None, follow: bool = True) -> tuple[jax.Array, jax.Array, Routing]:
    """Route normed hidden states h [X, E] -> (experts int32 [X, Kx], weights [X, Kx] in h's dtype,
    this layer's `Routing` with experts [X, Kx] and no L axis). `replay_XK`: the experts to use
    instead of the router's top-k (`follow`), or with follow=False only to compare the router's
    choice with (`Routing.mismatch`); `real_X` bool: the tokens counted in the statistics (all)."""
    X, k = h_XE.shape[0], cfg.num_experts_per_tok
    logits = jnp.einsum("xe,en->xn", h_XE, router_EEx)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    own_vals, own = jax.lax.top_k(probs, k)
    if replay_XK is None:
        experts, vals, mismatch = own, own_vals, jnp.zeros((X,), jnp.bool_)
    else:
        given = replay_XK.astype(jnp.int32)
        if k > 1:
            # A slot nothing was recorded for (a token never fed, padding) holds one id Kx times, which
            # no top-k gives: such a token takes its router's own choice, spread over the experts
            # (all-zero fillers would send every one to expert 0's device under expert parallelism).
            recorded = jnp.any(given != given[:, :1], axis=-1)
            given = jnp.where(recorded[:, None], given, own)
        mismatch = jnp.any(jnp.sort(own, axis=-1) != jnp.sort(given, axis=-1), axis=-1)
        experts, vals = (given, jnp.take_along_axis(probs, given, axis=-1)) if follow else (own, own_vals)
    if cfg.norm_topk_prob:
        # p_i / sum_S p_j is the softmax of the chosen logits: computed so, a replayed expert whose
        # probability underflows (the router moved far since sampling) still gets its weight.
        vals = jax.nn.softmax(jnp.take_along_axis(logits.astype(jnp.float32), experts, axis=-1), axis=-1)
    real = jnp.ones((X,), jnp.float32) if real_X is None else real_X.astype(jnp.float32)
    counts = tokens_per_expert(experts, real, cfg.num_experts)
    stats = Routing(experts=experts, counts=counts, prob_sums=jnp.einsum("x,xn->n", real, probs),
                    tokens=real.sum(), mismatch=jnp.sum(mismatch * real))
    return experts, vals.astype(h_XE.dtype), stats


def no_routing(cfg: TransformerConfig, tokens: int) -> Routing:
    """A dense layer's Routing in a mixed stack: expert 0 for every token (never used, never
    replayed into a dense layer) and no counts, so the statistics pool the sparse layers only."""
    f32 = jnp.float32
    return Routing(experts=jnp.zeros((tokens, cfg.num_experts_per_tok), jnp.int32),
                   counts=jnp.zeros((cfg.num_experts,), f32), prob_sums=jnp.zeros((cfg.num_experts,), f32),
                   tokens=jnp.zeros((), f32), mismatch=jnp.zeros((), f32))


def moe_mlp(h_XE: jax.Array, p: dict[str, jax.Array], cfg: TransformerConfig, *, replay_XK: jax.Array | None = None,
            real_X: jax.Array | None = None, follow: bool = True, mesh=None) -> tuple[jax.Array, Routing]:
    """The MoE MLP of normed hidden states h [X, E] with one layer's params `p` -> (output [X, E],
    Routing); `replay_XK`, `real_X`, `follow`: see `route`."""
    experts, weights, stats = route(h_XE, p["router"], cfg, replay_XK=replay_XK, real_X=real_X, follow=follow)
    out = expert_mlp(h_XE, experts, weights, p["expert_gate"], p["expert_up"], p["expert_down"],
                     activation=cfg.activation, mesh=mesh)
    return out, stats


def stack_layers(per_layer: Routing, shape_BT: tuple[int, int]) -> Routing:
    """A scan's per-layer Routing (leading L axis, experts [L, X, Kx]) -> experts [B, T, L, Kx]."""
    L, X, k = per_layer.experts.shape
    experts = per_layer.experts.reshape(L, *shape_BT, k).transpose(1, 2, 0, 3)
    return per_layer.replace(experts=experts)


def replay_per_layer(replay_BTLK: jax.Array | None, cfg: TransformerConfig, shape_BT: tuple[int, int]) -> jax.Array | None:
    """Replay experts int [B, T, L, Kx] -> [L, X, Kx] (a scan's per-layer slices), checked."""
    if replay_BTLK is None:
        return None
    want = (*shape_BT, cfg.num_layers, cfg.num_experts_per_tok)
    if replay_BTLK.shape != want:
        raise ValueError(f"routing replay has shape {replay_BTLK.shape}; this pass needs {want} "
                         "([rows, tokens, layers, experts per token])")
    B, T = shape_BT
    return replay_BTLK.transpose(2, 0, 1, 3).reshape(cfg.num_layers, B * T, -1)


def aux_loss(r: Routing) -> jax.Array:
    """float32 []: the load-balancing loss of Switch Transformer as HF's `load_balancing_loss_func`
    computes it, pooled over every layer's real tokens: Ex * sum_e f_e * P_e, f_e the fraction of
    (token, choice) pairs sent to expert e, P_e the mean router probability of e."""
    n = jnp.maximum(jnp.sum(r.tokens), 1.0)
    num_experts = r.counts.shape[-1]
    return num_experts * jnp.sum(r.counts.sum(0) / n * (r.prob_sums.sum(0) / n))


def concat(*parts: Routing) -> Routing:
    """Statistics of several passes' Routing summed (their experts are not merged: the first's is kept)."""
    first = parts[0]
    return first.replace(counts=sum(p.counts for p in parts), prob_sums=sum(p.prob_sums for p in parts),
                         tokens=sum(p.tokens for p in parts), mismatch=sum(p.mismatch for p in parts))


def metrics(r: Routing) -> dict[str, jax.Array]:
    """`moe/aux_loss`; `moe/expert_load_max`: the most (token, choice) pairs any expert of any layer
    got, over the number a balanced router gives each (1 = balanced, Ex = all to one expert);
    `moe/routing_mismatch`: the fraction of real token-layers whose router's own top-k set differs
    from the experts used (0 without replay)."""
    num_experts = r.counts.shape[-1]
    per_layer_pairs = jnp.maximum(r.counts.sum(-1, keepdims=True), 1.0)
    load = jnp.max(r.counts / per_layer_pairs) * num_experts
    return {"moe/aux_loss": aux_loss(r), "moe/expert_load_max": load,
            "moe/routing_mismatch": jnp.sum(r.mismatch) / jnp.maximum(jnp.sum(r.tokens), 1.0)}
