"""The training forward with each group's prompt computed once.

A GRPO batch holds G completions of every prompt (rows i*G .. i*G+G-1 share prompt i). The plain
pass runs each row's own copy of the prompt, R x (P + T) tokens; `grouped_hidden_states` runs the
N distinct prompts and the R = N x G completions in one layer scan, N x P + R x T tokens. Per
layer, a completion's queries attend its group's prompt keys/values and its own earlier tokens. It is an
ordinary differentiable forward: the gradients of all G completions meet in the one prompt pass.

Positions, masks and the sliding window are those the plain pass gives the concatenated
[prompt, completion] row (completion token t of prompt i sits at position len_i + t; every
completion token is a real key), so the two agree up to float rounding. Per layer, the prompt's
keys and values are repeated for its G completions ([R, P + T] key slots, the prompt's first):
P x K x D numbers per row, small beside the rows' activations, and it lets every attention
implementation (`model.attention`) run the completions' attention as one causal call.

Shape letters: grpo_jax.shapes (here T is a completion's tokens, and S = P + T the key slots
that a completion token's attention reads).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from grpo_jax.models.layers import (as_mask, attention, attention_impl, default_positions, finish_layer, qkv, rms_norm,
                                    rope_tables)
from grpo_jax.models.layer_scan import compute_dtype, run_layers
from grpo_jax.models.moe import concat, replay_per_layer, stack_layers


def grouped_hidden_states(model, prompt_ids: jax.Array, prompt_mask: jax.Array | None, completion_ids: jax.Array,
                          *, dropout_key: jax.Array | None = None, row_sharding=None) -> tuple[jax.Array, jax.Array]:
    """Final-normed hidden states of N prompts and their R = N x G completions (see
    `grouped_routed_hidden_states`, which also takes routing replay and says what the routers did)."""
    return grouped_routed_hidden_states(model, prompt_ids, prompt_mask, completion_ids, dropout_key=dropout_key,
                                        row_sharding=row_sharding)[:2]


def grouped_routed_hidden_states(model, prompt_ids: jax.Array, prompt_mask: jax.Array | None,
                                 completion_ids: jax.Array, *, dropout_key: jax.Array | None = None, row_sharding=None,
                                 prompt_routing: jax.Array | None = None, completion_routing: jax.Array | None = None,
                                 completion_mask: jax.Array | None = None, replay: bool = True):
    """Final-normed hidden states of N prompts and their R = N x G completions, in `model`'s compute dtype.

    prompt_ids int [N, P] (left-padded, prompt_mask [N, P], 1 = real), completion_ids int [R, T]
    (row i*G + j continues prompt i) -> (h_prompt [N, P, E], h_completion [R, T, E]): what
    `model.hidden_states` gives on each row's [prompt, completion] (completion all real tokens),
    and the `moe.Routing` of both (None if dense; its experts are the completions'). `dropout_key`,
    `row_sharding`: `model.hidden_states`'s. MoE: `prompt_routing` int [N, P, L, Kx] and
    `completion_routing` [R, T, L, Kx] (both or neither) are replayed, or only compared
    (replay=False, `moe.route`); `completion_mask` [R, T]: the tokens its statistics count (all)."""
    cfg, dtype, _ = model.config, model.dtype, chex.assert_rank([prompt_ids, completion_ids], 2)
    (N, P), (R, T) = prompt_ids.shape, completion_ids.shape
    G, pmask_NP, pos_NP, pos_RT, kv_seg_RS, kv_pos_RS = _layout(prompt_mask, (N, P), (R, T))
    pseg_NP = pmask_NP.astype(jnp.int32)
    (cos_YNPD, sin_YNPD), (cos_YRTD, sin_YRTD) = rope_tables(cfg, pos_NP, dtype), rope_tables(cfg, pos_RT, dtype)
    mesh = None if row_sharding is None else row_sharding.mesh
    moe_kw = dict(follow=replay, mesh=mesh)
    prompt_impl = attention_impl(model.attention, cfg, keys=P, mesh=mesh)
    completion_impl = attention_impl(model.attention, cfg, keys=P + T, mesh=mesh, pass_name="shared_prompt")
    replay_L = _replay(cfg, prompt_routing, completion_routing, (N, P), (R, T))
    real_NP, real_RT = pmask_NP.reshape(-1), as_mask(completion_mask, (R, T)).reshape(-1)

    # Prompts and completions stay two arrays, not one token axis: on CPU, concatenating them for
    # shared projection matmuls and slicing them apart each layer made the forward ~20% slower.
    def body(x, xs):
        x_NPE, x_RTE = x
        p, kind, (replay_p, replay_c) = xs
        p = compute_dtype(p, dtype)
        qp, kp, vp = qkv(x_NPE, p, cfg, cos_YNPD[kind], sin_YNPD[kind])  # [N, P, H, D], [N, P, K, D] x 2
        qc, kc, vc = qkv(x_RTE, p, cfg, cos_YRTD[kind], sin_YRTD[kind])  # [R, T, H, D], [R, T, K, D] x 2
        # Named as the plain pass names them (`model.remat: attention` keeps them).
        qp, kp, vp, qc, kc, vc = (checkpoint_name(a, "qkv") for a in (qp, kp, vp, qc, kc, vc))
        out_NPHD = attention(qp, kp, vp, q_segment_ids=pseg_NP, kv_segment_ids=pseg_NP, q_positions=pos_NP,
                             kv_positions=pos_NP, kind=kind, cfg=cfg, impl=prompt_impl, mesh=mesh)
        # The prompt's keys and values are read by each of its G completions: [R, P + T, K, D].
        k_RSKD = jnp.concatenate([jnp.repeat(kp, G, axis=0), kc], axis=1)
        v_RSKD = jnp.concatenate([jnp.repeat(vp, G, axis=0), vc], axis=1)
        out_RTHD = attention(qc, k_RSKD, v_RSKD, q_segment_ids=jnp.ones((R, T), jnp.int32), kv_segment_ids=kv_seg_RS,
                             q_positions=pos_RT, kv_positions=kv_pos_RS, kind=kind, cfg=cfg, impl=completion_impl,
                             mesh=mesh)
        out_NPHD, out_RTHD = checkpoint_name(out_NPHD, "attention"), checkpoint_name(out_RTHD, "attention")
        x_NPE, routed_p = finish_layer(x_NPE, out_NPHD, p, cfg, replay_XK=replay_p, real_X=real_NP, **moe_kw)
        x_RTE, routed_c = finish_layer(x_RTE, out_RTHD, p, cfg, replay_XK=replay_c, real_X=real_RT, **moe_kw)
        return (x_NPE, x_RTE), (routed_p, routed_c)

    (x_NPE, x_RTE), (routed_p, routed_c) = run_layers(
        model, body, (model.embed_tokens(prompt_ids), model.embed_tokens(completion_ids)), dropout_key=dropout_key,
        row_sharding=row_sharding, extra=replay_L)
    routed = concat(stack_layers(routed_c, (R, T)), routed_p) if cfg.is_moe else None
    return rms_norm(x_NPE, model.final_norm[...], cfg), rms_norm(x_RTE, model.final_norm[...], cfg), routed


def _layout(prompt_mask, shape_NP, shape_RT):
    """(G, the prompts' mask [N, P], their positions [N, P], the completions' positions [R, T], and
    each completion's keys' segments and positions [R, P + T]: its prompt's slots, then its own)."""
    (N, P), (R, T) = shape_NP, shape_RT
    if R % N:
        raise ValueError(f"{R} completion rows are not whole groups of the {N} prompts")
    G = R // N
    pmask_NP = as_mask(prompt_mask, (N, P))
    pos_NP = default_positions(pmask_NP)
    # As the plain pass: completion token t follows the prompt's real tokens.
    pos_RT = jnp.repeat(pmask_NP.sum(axis=1, dtype=jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32), G, axis=0)
    # A completion's keys are its prompt's slots, then its own tokens: segment 1 for every real one.
    kv_seg_RS, kv_pos_RS = (jnp.concatenate([jnp.repeat(a, G, axis=0), b], axis=1)
                            for a, b in ((pmask_NP.astype(jnp.int32), jnp.ones((R, T), jnp.int32)), (pos_NP, pos_RT)))
    return G, pmask_NP, pos_NP, pos_RT, kv_seg_RS, kv_pos_RS


def _replay(cfg, prompt_routing, completion_routing, shape_NP, shape_RT):
    """(prompt, completion) replay per layer ([L, X, Kx] each), or (None, None)."""
    if (prompt_routing is None) != (completion_routing is None):
        raise ValueError("routing replay needs both the prompts' and the completions' experts, or neither")
    if prompt_routing is not None and not cfg.is_moe:
        raise ValueError("routing replay was given to a dense model (it has no experts)")
    return (replay_per_layer(prompt_routing, cfg, shape_NP), replay_per_layer(completion_routing, cfg, shape_RT))
