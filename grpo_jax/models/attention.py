"""The one attention function every model pass calls (`attend`), with its implementation chosen by
name: plain XLA ("xla", the reference), a pure-JAX flash-style chunked loop ("chunked"), and the
Pallas kernels of `grpo_jax.models.kernels` ("splash" on TPU, "gpu").

Every implementation takes the mask as ids and positions instead of a [B, T, S] array, so a packed
batch (several sequences per row, a completion seeing its group's shared prompt) costs no O(T x S)
input. The visibility rule, for query t and key s:

    kv_seg[s] != 0                                   (0 marks padding)
    and (kv_seg[s] == q_seg[t] or kv_seg[s] == q_parent[t])   (parents optional; parent 0 = none)
    and (not causal or s <= t + (S - T))             (queries are the last T slots of the key axis)
    and (window is None or q_pos[t] - kv_pos[s] < window)

A query that sees no key gets exactly 0 (never NaN, in values or gradients).

This module imports nothing of the package: `layers` calls it, and `kernels` is imported lazily
(only when its implementations are asked for), so neither may import this module back.

Shape letters: grpo_jax.shapes (W = Q x bq: a query block's rows of one kv head).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

IMPLS = ("xla", "chunked", "splash", "gpu")
"""The attention implementations (`model.attention`'s choices besides "auto")."""

NEG = float(np.finfo(np.float32).min)
"""The score of a masked key in the XLA path: the float32 minimum, so a softmax gives it 0 weight."""


def attend(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, q_segment_ids: jax.Array,
           kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
           q_parent_ids: jax.Array | None = None, causal: bool = True, window: int | jax.Array | None = None,
           softcap: float | None = None, scale: float, impl: str = "xla", block_q: int = 512, block_k: int = 512,
           mesh=None, interpret: bool = False) -> jax.Array:
    """Softmax attention of queries [B, T, H, D] over keys and values [B, S, K, D] -> [B, T, H, D]
    in q's dtype, under the module's visibility rule.

    H = K x Q: query head h reads kv head h // Q (GQA; K = 1 is MQA), and no implementation repeats
    k or v. Ids and positions are int32: q_segment_ids, q_positions, q_parent_ids [B, T];
    kv_segment_ids, kv_positions [B, S]. Positions only matter for the sliding `window` (an int, or
    an int32 scalar that may be traced, e.g. picked by a scanned layer's kind). Scores are
    (q . k) x `scale` in float32, then `softcap` x tanh(score / `softcap`) when given, then masked.

    `impl` picks the implementation (IMPLS). `block_q`/`block_k` are the "chunked" path's block
    sizes (capped at T and S; lengths they do not divide are padded inside, so pick divisors).
    `mesh` and `interpret` are for the Pallas kernels ("splash", "gpu"); the pure-JAX paths are
    partitioned by the compiler from their inputs' shardings and need no mesh.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}: choose one of {IMPLS}")
    if interpret and impl not in ("splash", "gpu"):
        raise ValueError(f"interpret=True runs a Pallas kernel in the interpreter; impl {impl!r} has no kernel "
                         "(use 'splash' or 'gpu', or leave interpret False)")
    _check_shapes(q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, q_positions, kv_positions, q_parent_ids)
    ids = {"q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "q_positions": q_positions,
           "kv_positions": kv_positions, "q_parent_ids": q_parent_ids, "causal": causal, "window": window,
           "softcap": softcap, "scale": scale}
    if impl == "xla":
        return reference_attention(q_BTHD, k_BSKD, v_BSKD, **ids)
    if impl == "chunked":
        return chunked_attention(q_BTHD, k_BSKD, v_BSKD, **ids, block_q=block_q, block_k=block_k)
    # Imported here so this module (and every model) works where the Pallas kernels cannot be imported.
    from grpo_jax.models import kernels

    kernel = kernels.splash_attention if impl == "splash" else kernels.gpu_attention
    return kernel(q_BTHD, k_BSKD, v_BSKD, **ids, mesh=mesh, interpret=interpret)


def _check_shapes(q, k, v, q_seg, kv_seg, q_pos, kv_pos, q_par) -> None:
    chex.assert_rank(q, 4)
    B, T, H, D = q.shape
    chex.assert_rank(k, 4)
    S, K = k.shape[1], k.shape[2]
    chex.assert_shape([k, v], (B, S, K, D))
    if H % K:
        raise ValueError(f"{H} query heads cannot share {K} key/value heads: H must be a multiple of K")
    chex.assert_shape([q_seg, q_pos] + ([] if q_par is None else [q_par]), (B, T))
    chex.assert_shape([kv_seg, kv_pos], (B, S))


def visible(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, q_parent_ids: jax.Array | None,
            q_index: jax.Array, kv_index: jax.Array, *, offset: int, causal: bool, q_positions: jax.Array,
            kv_positions: jax.Array, window: int | jax.Array | None) -> jax.Array:
    """bool [B, t, s]: the module's visibility rule for t queries (ids, positions [B, t], slot
    indices [t]) and s keys (ids, positions [B, s], slot indices [s]), built by broadcasting, where
    `offset` = S - T aligns the queries with the end of the key axis."""
    kv_seg = kv_segment_ids[:, None, :]
    same = kv_seg == q_segment_ids[:, :, None]
    if q_parent_ids is not None:
        same = same | (kv_seg == q_parent_ids[:, :, None])
    seen = (kv_seg != 0) & same
    if causal:
        seen = seen & (kv_index[None, None, :] <= q_index[None, :, None] + offset)
    if window is not None:
        seen = seen & (q_positions[:, :, None] - kv_positions[:, None, :] < window)
    return seen


def _capped(s: jax.Array, cap: float | None) -> jax.Array:
    """cap x tanh(s / cap) (Gemma's attention soft cap); s itself when cap is None."""
    return s if cap is None else jnp.tanh(s / cap) * cap


def reference_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, q_segment_ids: jax.Array,
                        kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                        q_parent_ids: jax.Array | None = None, causal: bool = True,
                        window: int | jax.Array | None = None, softcap: float | None = None,
                        scale: float) -> jax.Array:
    """The "xla" path: `attend` with the full scores [B, K, Q, T, S] materialised, the reference for
    the other paths and the fastest choice for short sequences (one fused softmax, no loops)."""
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    Q = H // K
    # The Q query heads of a kv head and the T positions fold into one axis W = Q x T, so both
    # contractions are plain batched matmuls over (row, kv head): 1.5x faster on CPU than
    # contracting [B, K, Q, T, D] (benchmarks/results/attention/cpu.json).
    q_BKWD = q_BTHD.reshape(B, T, K, Q, D).transpose(0, 2, 3, 1, 4).reshape(B, K, Q * T, D)
    k_BKSD, v_BKSD = k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3)
    s_BKWS = jnp.einsum("bkwd,bksd->bkws", q_BKWD, k_BKSD, preferred_element_type=jnp.float32) * scale
    s_BKQTS = _capped(s_BKWS, softcap).reshape(B, K, Q, T, S)
    seen_BTS = visible(q_segment_ids, kv_segment_ids, q_parent_ids, jnp.arange(T), jnp.arange(S), offset=S - T,
                       causal=causal, q_positions=q_positions, kv_positions=kv_positions, window=window)
    seen = seen_BTS[:, None, None]
    # The outer where zeroes the rows that see nothing (their softmax over all-NEG scores is uniform).
    p_BKQTS = jnp.where(seen, jax.nn.softmax(jnp.where(seen, s_BKQTS, NEG), axis=-1), 0.0)
    p_BKWS = p_BKQTS.reshape(B, K, Q * T, S).astype(v_BSKD.dtype)
    out_BKWD = jnp.einsum("bkws,bksd->bkwd", p_BKWS, v_BKSD)
    return out_BKWD.reshape(B, K, Q, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)


class _Plan(NamedTuple):
    """The static facts of one chunked call: the true lengths (the causal offset is S - T), the
    block sizes, and the score transform."""
    T: int
    S: int
    bq: int
    bk: int
    causal: bool
    softcap: float | None
    scale: float


def chunked_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, q_segment_ids: jax.Array,
                      kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                      q_parent_ids: jax.Array | None = None, causal: bool = True,
                      window: int | jax.Array | None = None, softcap: float | None = None, scale: float,
                      block_q: int = 512, block_k: int = 512) -> jax.Array:
    """The "chunked" path: FlashAttention-2 in pure JAX. Queries go in blocks of block_q, each over
    key blocks of block_k with an online softmax, so temporaries are O(T x block), never O(T x S);
    causal calls skip the key blocks above the diagonal. A custom VJP keeps only the output and the
    log-sum-exp (float32 [B, H, T]) and recomputes the block scores backward.

    Block sizes are capped at T and S; T and S are padded up to block multiples inside (padding keys
    get segment 0, so they are masked), which costs copies: pick block sizes that divide them.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"attention block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    plan = _Plan(T=T, S=S, bq=min(block_q, T), bk=min(block_k, S), causal=bool(causal),
                 softcap=None if softcap is None else float(softcap), scale=float(scale))
    Tp, Sp = -(-T // plan.bq) * plan.bq, -(-S // plan.bk) * plan.bk
    q_BKQTD = _pad(q_BTHD.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4), 3, Tp)
    k_BKSD, v_BKSD = (_pad(a.transpose(0, 2, 1, 3), 2, Sp) for a in (k_BSKD, v_BSKD))
    ids = {"q_seg": _pad(q_segment_ids, 1, Tp), "kv_seg": _pad(kv_segment_ids, 1, Sp),
           "q_pos": _pad(q_positions, 1, Tp), "kv_pos": _pad(kv_positions, 1, Sp)}
    if q_parent_ids is not None:
        ids["q_par"] = _pad(q_parent_ids, 1, Tp)
    if window is not None:
        ids["window"] = jnp.asarray(window, jnp.int32)
    out_BKQTD = _flash(plan, q_BKQTD, k_BKSD, v_BKSD, ids)
    return out_BKQTD[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _pad(a: jax.Array, axis: int, size: int) -> jax.Array:
    """a with zeros appended along `axis` up to `size` (zero ids: padding)."""
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def _key_blocks(plan: _Plan, i: jax.Array, nk: int) -> jax.Array | int:
    """How many key blocks query block i reads: all, or (causal) up to the one holding the last key
    its last query may see; the blocks above the diagonal are never computed."""
    if not plan.causal:
        return nk
    last_key = (i + 1) * plan.bq - 1 + plan.S - plan.T
    return jnp.clip(last_key // plan.bk + 1, 0, nk)


def _block_scores(plan: _Plan, q_BKWD: jax.Array, k_BKSD: jax.Array) -> jax.Array:
    """float32 capped scores [B, K, Q, bq, bk] of one query block against one key block."""
    B, K, W, _ = q_BKWD.shape
    s_BKWS = jnp.einsum("bkwd,bksd->bkws", q_BKWD, k_BKSD, preferred_element_type=jnp.float32) * plan.scale
    return _capped(s_BKWS, plan.softcap).reshape(B, K, W // plan.bq, plan.bq, plan.bk)


def _block_visible(plan: _Plan, ids: dict[str, jax.Array], i: jax.Array, j: jax.Array) -> jax.Array:
    """bool [B, 1, 1, bq, bk]: which keys of key block j the queries of query block i see."""
    def rows(a):
        return jax.lax.dynamic_slice_in_dim(a, i * plan.bq, plan.bq, axis=1)

    def cols(a):
        return jax.lax.dynamic_slice_in_dim(a, j * plan.bk, plan.bk, axis=1)

    seen = visible(rows(ids["q_seg"]), cols(ids["kv_seg"]), rows(ids["q_par"]) if "q_par" in ids else None,
                   i * plan.bq + jnp.arange(plan.bq), j * plan.bk + jnp.arange(plan.bk), offset=plan.S - plan.T,
                   causal=plan.causal, q_positions=rows(ids["q_pos"]), kv_positions=cols(ids["kv_pos"]),
                   window=ids.get("window"))
    return seen[:, None, None]


def _query_block(plan: _Plan, a: jax.Array, i: jax.Array) -> jax.Array:
    """Query block i of a [B, K, Q, Tp, ...] as [B, K, W, ...] (the Q heads' rows side by side)."""
    a = jax.lax.dynamic_slice_in_dim(a, i * plan.bq, plan.bq, axis=3)
    return a.reshape(a.shape[0], a.shape[1], -1, *a.shape[4:])


def _key_block(plan: _Plan, a: jax.Array, j: jax.Array) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, j * plan.bk, plan.bk, axis=2)


def _forward_block(plan: _Plan, q, k, v, ids, i) -> tuple[jax.Array, jax.Array]:
    """Query block i's output [B, K, Q, bq, D] (q's dtype) and log-sum-exp [B, K, Q, bq] (float32)
    by the online softmax over its key blocks: a running max m, sum l and accumulator acc."""
    B, K, Q, _, D = q.shape
    q_i = _query_block(plan, q, i)

    def step(j, carry):
        m, l, acc = carry
        s = _block_scores(plan, q_i, _key_block(plan, k, j))
        seen = _block_visible(plan, ids, i, j)
        m_new = jnp.maximum(m, jnp.max(jnp.where(seen, s, NEG), axis=-1))
        # Masked by `where`, not by a NEG score: while a row has seen nothing its max is NEG itself.
        p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("bkws,bksd->bkwd", p.reshape(B, K, Q * plan.bq, plan.bk).astype(v.dtype),
                        _key_block(plan, v, j), preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv.reshape(acc.shape)

    init = (jnp.full((B, K, Q, plan.bq), NEG, jnp.float32), jnp.zeros((B, K, Q, plan.bq), jnp.float32),
            jnp.zeros((B, K, Q, plan.bq, D), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, _key_blocks(plan, i, k.shape[2] // plan.bk), step, init)
    seen_any = l > 0
    l_safe = jnp.where(seen_any, l, 1.0)
    out = jnp.where(seen_any[..., None], acc / l_safe[..., None], 0.0)
    return out.astype(q.dtype), jnp.where(seen_any, m + jnp.log(l_safe), 0.0)


def _forward(plan: _Plan, q, k, v, ids) -> tuple[jax.Array, jax.Array]:
    """Output [B, K, Q, Tp, D] and log-sum-exp [B, K, Q, Tp], one query block at a time."""
    def body(i, bufs):
        out_i, lse_i = _forward_block(plan, q, k, v, ids, i)
        return (jax.lax.dynamic_update_slice_in_dim(bufs[0], out_i, i * plan.bq, axis=3),
                jax.lax.dynamic_update_slice_in_dim(bufs[1], lse_i, i * plan.bq, axis=3))

    init = (jnp.zeros_like(q), jnp.zeros(q.shape[:4], jnp.float32))
    return jax.lax.fori_loop(0, q.shape[3] // plan.bq, body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, q, k, v, ids):
    """Chunked attention on the padded head-major layout: q [B, K, Q, Tp, D], k and v [B, K, Sp, D]."""
    return _forward(plan, q, k, v, ids)[0]


def _flash_fwd(plan: _Plan, q, k, v, ids):
    out, lse = _forward(plan, q, k, v, ids)
    # Named, so a remat policy that saves "attention" (`model.remat: attention`) keeps what the
    # backward pass reads instead of running the forward loops again to rebuild the log-sum-exp.
    q, k, v, out, lse = (checkpoint_name(a, "attention") for a in (q, k, v, out, lse))
    return out, (q, k, v, ids, out, lse)


def _add_at(acc: jax.Array, x: jax.Array, start: jax.Array) -> jax.Array:
    """acc with x added to its slots [start, start + len(x)) of axis 2."""
    current = jax.lax.dynamic_slice_in_dim(acc, start, x.shape[2], axis=2)
    return jax.lax.dynamic_update_slice_in_dim(acc, current + x, start, axis=2)


def _backward_block(plan: _Plan, res, do, delta, i, dk, dv):
    """FlashAttention-2's backward for query block i: its dq [B, K, W, D] and the key blocks' dk, dv
    [B, K, Sp, D] (float32) accumulated, from recomputed probabilities P = exp(s - lse):
    dS = P (dP - delta), through the soft cap's derivative 1 - tanh^2 and the scale."""
    q, k, v, ids, _, lse = res
    B, K, Q, _, D = q.shape
    q_i, do_i, lse_i, delta_i = (_query_block(plan, a, i) for a in (q, do, lse, delta))
    lse_i, delta_i = (a.reshape(B, K, Q, plan.bq, 1) for a in (lse_i, delta_i))

    def step(j, carry):
        dq_i, dk, dv = carry
        k_j, v_j = _key_block(plan, k, j), _key_block(plan, v, j)
        s = _block_scores(plan, q_i, k_j)
        p = jnp.where(_block_visible(plan, ids, i, j), jnp.exp(s - lse_i), 0.0)
        dp = jnp.einsum("bkwd,bksd->bkws", do_i, v_j, preferred_element_type=jnp.float32)
        ds = p * (dp.reshape(p.shape) - delta_i)
        if plan.softcap is not None:
            ds = ds * (1.0 - jnp.square(s / plan.softcap))
        ds = (ds * plan.scale).reshape(B, K, Q * plan.bq, plan.bk)
        p = p.reshape(ds.shape)
        dv_j = jnp.einsum("bkws,bkwd->bksd", p.astype(do.dtype), do_i, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bkws,bkwd->bksd", ds.astype(q.dtype), q_i, preferred_element_type=jnp.float32)
        dq_i = dq_i + jnp.einsum("bkws,bksd->bkwd", ds.astype(k.dtype), k_j, preferred_element_type=jnp.float32)
        return dq_i, _add_at(dk, dk_j, j * plan.bk), _add_at(dv, dv_j, j * plan.bk)

    init = (jnp.zeros((B, K, Q * plan.bq, D), jnp.float32), dk, dv)
    return jax.lax.fori_loop(0, _key_blocks(plan, i, k.shape[2] // plan.bk), step, init)


def _flash_bwd(plan: _Plan, res, do):
    q, k, v, _, out, _ = res
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, K, Q, Tp]

    def body(i, bufs):
        dq, dk, dv = bufs
        dq_i, dk, dv = _backward_block(plan, res, do, delta, i, dk, dv)
        dq_i = dq_i.reshape(*q.shape[:3], plan.bq, q.shape[4])
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * plan.bq, axis=3), dk, dv

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, q.shape[3] // plan.bq, body, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
