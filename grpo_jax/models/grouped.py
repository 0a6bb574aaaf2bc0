"""The training forward with each group's prompt computed once.

A GRPO batch holds G completions of every prompt (rows i*G .. i*G+G-1 share prompt i). The plain
pass runs each row's own copy of the prompt, R x (P + T) tokens; `grouped_hidden_states` runs the
N distinct prompts and the R = N x G completions in one layer scan, N x P + R x T tokens. Per
layer, a completion's queries attend its group's prompt keys/values, read once per group (the
queries of the G rows are batched against them, no copies), and its own earlier tokens. It is an
ordinary differentiable forward: the gradients of all G completions meet in the one prompt pass.

Positions, masks and the sliding window are those the plain pass gives the concatenated
[prompt, completion] row (completion token t of prompt i sits at position len_i + t; every
completion token is a real key), so the two agree up to float rounding.

Shape letters: grpo_jax.shapes (here T is a completion's tokens, and S = P + T the key slots
that a completion token's attention reads).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from grpo_jax.models.config import TransformerConfig
from grpo_jax.models.layers import (NEG, as_mask, attention, default_positions, finish_layer, qkv, rms_norm,
                                    rope_tables, softcap)
from grpo_jax.models.transformer import compute_dtype, run_layers


def grouped_hidden_states(model, prompt_ids: jax.Array, prompt_mask: jax.Array | None, completion_ids: jax.Array,
                          *, dropout_key: jax.Array | None = None, row_sharding=None) -> tuple[jax.Array, jax.Array]:
    """Final-normed hidden states of N prompts and their R = N x G completions, in `model`'s compute dtype.

    prompt_ids int [N, P] (left-padded, prompt_mask [N, P], 1 = real), completion_ids int [R, T]
    (row i*G + j continues prompt i) -> (h_prompt [N, P, E], h_completion [R, T, E]): what
    `model.hidden_states` gives on each row's [prompt, completion] (completion all real tokens).
    `dropout_key`, `row_sharding`: as `model.hidden_states`'s.
    """
    cfg, dtype = model.config, model.dtype
    chex.assert_rank([prompt_ids, completion_ids], 2)
    (N, P), (R, T) = prompt_ids.shape, completion_ids.shape
    if R % N:
        raise ValueError(f"{R} completion rows are not whole groups of the {N} prompts")
    pmask_NP = as_mask(prompt_mask, (N, P))
    pos_NP = default_positions(pmask_NP)
    # As the plain pass: completion token t follows the prompt's real tokens.
    pos_NT = pmask_NP.sum(axis=1, dtype=jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)
    cos_YNPD, sin_YNPD = rope_tables(cfg, pos_NP, dtype)
    cos_YRTD, sin_YRTD = rope_tables(cfg, jnp.repeat(pos_NT, R // N, axis=0), dtype)
    prompt_masks, completion_masks = _masks(cfg, pmask_NP, pos_NP, pos_NT)

    # Prompts and completions stay two arrays, not one token axis: on CPU, concatenating them for
    # shared projection matmuls and slicing them apart each layer made the forward ~20% slower.
    def body(x, xs):
        x_NPE, x_RTE = x
        p, kind = xs
        p = compute_dtype(p, dtype)
        qp, kp, vp = qkv(x_NPE, p, cfg, cos_YNPD[kind], sin_YNPD[kind])  # [N, P, H, D], [N, P, K, D] x 2
        qc, kc, vc = qkv(x_RTE, p, cfg, cos_YRTD[kind], sin_YRTD[kind])  # [R, T, H, D], [R, T, K, D] x 2
        kp, vp = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)  # [N, K, P, D]
        out_NPHD = attention(qp, kp, vp, prompt_masks[kind], cfg)
        out_RTHD = _completion_attention(qc, kp, vp, kc, vc, completion_masks[kind], cfg)
        return (finish_layer(x_NPE, out_NPHD, p, cfg), finish_layer(x_RTE, out_RTHD, p, cfg)), None

    x0 = (model.embed_tokens(prompt_ids), model.embed_tokens(completion_ids))
    (x_NPE, x_RTE), _ = run_layers(model, body, x0, dropout_key=dropout_key, row_sharding=row_sharding)
    return rms_norm(x_NPE, model.final_norm[...], cfg), rms_norm(x_RTE, model.final_norm[...], cfg)


def _masks(cfg: TransformerConfig, pmask_NP, pos_NP, pos_NT):
    """Per layer kind (stacked on Y): the prompt's own causal mask [Y, N, P, P], and what a
    completion token may attend [Y, N, T, S]: its prompt's real slots, then its own row's tokens
    up to itself, both within the sliding window (the same for the G rows of a group)."""
    P, T = pmask_NP.shape[1], pos_NT.shape[1]
    causal_NPP = jnp.tril(jnp.ones((P, P), jnp.bool_))[None] & pmask_NP[:, None, :]
    causal_TT = jnp.tril(jnp.ones((T, T), jnp.bool_))
    prompt, completion = [], []
    for kind in cfg.kinds:
        window = cfg.window_of(kind)
        if window is None:
            prompt.append(causal_NPP)
            to_prompt_NTP = jnp.broadcast_to(pmask_NP[:, None, :], (*pos_NT.shape, P))
            to_self_NTT = jnp.broadcast_to(causal_TT, (pos_NT.shape[0], T, T))
        else:
            prompt.append(causal_NPP & (pos_NP[:, :, None] - pos_NP[:, None, :] < window))
            to_prompt_NTP = pmask_NP[:, None, :] & (pos_NT[:, :, None] - pos_NP[:, None, :] < window)
            # Completion positions are consecutive, so the distance between tokens t and s is t - s.
            gap_TT = jnp.arange(T)[:, None] - jnp.arange(T)[None, :]
            to_self_NTT = jnp.broadcast_to(causal_TT & (gap_TT < window), (pos_NT.shape[0], T, T))
        completion.append(jnp.concatenate([to_prompt_NTP, to_self_NTT], axis=-1))
    return jnp.stack(prompt), jnp.stack(completion)


def _completion_attention(q_RTHD, kp_NKPD, vp_NKPD, kc_RTKD, vc_RTKD, mask_NTS, cfg: TransformerConfig):
    """Attention of completion tokens over [their group's prompt slots, their own tokens] -> [R, T, H, D].

    The prompt keys/values [N, K, P, D] are contracted against the queries of all G rows of the
    group at once (the G rows are a free axis of the matmul), so they are never repeated G times.
    """
    N = kp_NKPD.shape[0]
    R, T, H, D = q_RTHD.shape
    G, K = R // N, kp_NKPD.shape[1]
    Q = H // K
    q_NGKWD = q_RTHD.reshape(N, G, T, K, Q, D).transpose(0, 1, 3, 4, 2, 5).reshape(N, G, K, Q * T, D)
    kc_NGKTD = kc_RTKD.reshape(N, G, T, K, D).transpose(0, 1, 3, 2, 4)
    vc_NGKTD = vc_RTKD.reshape(N, G, T, K, D).transpose(0, 1, 3, 2, 4)
    s_prompt = jnp.einsum("ngkwd,nkpd->ngkwp", q_NGKWD, kp_NKPD, preferred_element_type=jnp.float32)
    s_self = jnp.einsum("ngkwd,ngktd->ngkwt", q_NGKWD, kc_NGKTD, preferred_element_type=jnp.float32)
    s_NGKWS = softcap(jnp.concatenate([s_prompt, s_self], axis=-1) * cfg.query_scale, cfg.attn_logit_softcap)
    S = s_NGKWS.shape[-1]
    s_NGKQTS = jnp.where(mask_NTS[:, None, None, None], s_NGKWS.reshape(N, G, K, Q, T, S), NEG)
    p_NGKWS = jax.nn.softmax(s_NGKQTS, axis=-1).reshape(N, G, K, Q * T, S).astype(vp_NKPD.dtype)
    P = kp_NKPD.shape[2]
    out_NGKWD = (jnp.einsum("ngkwp,nkpd->ngkwd", p_NGKWS[..., :P], vp_NKPD)
                 + jnp.einsum("ngkwt,ngktd->ngkwd", p_NGKWS[..., P:], vc_NGKTD))
    return out_NGKWD.reshape(N, G, K, Q, T, D).transpose(0, 1, 4, 2, 3, 5).reshape(R, T, H, D)
