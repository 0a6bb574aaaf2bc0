"""grpo_jax.models.attention: the XLA and chunked paths against a NumPy statement of the visibility
rule and softmax (written here, independent of the module), the chunked custom VJP against XLA's
autodiff, and the chunked path's memory staying O(T x block) where the XLA path's is O(T x S)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models.attention import IMPLS, attend

B, H, K, D = 2, 4, 2, 8
SCALE = D ** -0.5


def numpy_attention(q, k, v, *, q_seg, kv_seg, q_pos, kv_pos, q_par, causal, window, softcap, scale):
    """The visibility rule and softmax in float64 NumPy; kv head h // Q serves query head h."""
    T, S, Q = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = np.repeat(k, Q, axis=2).astype(np.float64), np.repeat(v, Q, axis=2).astype(np.float64)
    s = np.einsum("bthd,bshd->bhts", q.astype(np.float64), k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    kv_row = kv_seg[:, None, :]
    seen = (kv_row != 0) & ((kv_row == q_seg[:, :, None]) | (q_par is not None and kv_row == q_par[:, :, None]))
    if causal:
        seen &= np.arange(S)[None, None, :] <= np.arange(T)[None, :, None] + (S - T)
    if window is not None:
        seen &= q_pos[:, :, None] - kv_pos[:, None, :] < window
    seen = np.broadcast_to(seen[:, None], s.shape)
    top = np.max(np.where(seen, s, -np.inf), axis=-1, keepdims=True)
    e = np.where(seen, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    return np.einsum("bhts,bshd->bthd", p, v)


def positions(seg_BS, parent_len_BS=None):
    """Each segment's positions count from 0 (plus its parent's length: a completion continues its prompt)."""
    pos = np.zeros_like(seg_BS)
    for b, row in enumerate(seg_BS):
        for s in range(1, len(row)):
            pos[b, s] = pos[b, s - 1] + 1 if row[s] == row[s - 1] else 0
    return pos if parent_len_BS is None else pos + parent_len_BS


def layout(prefix, own, parents):
    """Ids and positions of B rows: `prefix` [B, P] segment ids of P prefix key slots, `own` [B, T]
    the queries' segment ids (also the last T key slots), `parents` {segment: parent segment}."""
    kv_seg = np.concatenate([np.asarray(prefix, np.int32).reshape(B, -1), np.asarray(own, np.int32)], axis=1)
    q_seg = kv_seg[:, kv_seg.shape[1] - len(own[0]):]
    q_par = np.vectorize(lambda s: parents.get(int(s), 0))(q_seg).astype(np.int32) if parents else None
    parent_len = np.zeros_like(kv_seg)
    if parents:
        for b in range(B):
            for child, parent in parents.items():
                parent_len[b, kv_seg[b] == child] = np.sum(kv_seg[b] == parent)
    kv_pos = positions(kv_seg, parent_len)
    return {"q_seg": q_seg, "kv_seg": kv_seg, "q_pos": kv_pos[:, kv_seg.shape[1] - q_seg.shape[1]:],
            "kv_pos": kv_pos, "q_par": q_par}


def runs(*lengths):
    return [seg for seg, n in lengths for _ in range(n)]


# T = 37 throughout (no block divides it); rows hold several packed segments, padding at both ends.
SELF = [runs((0, 2), (1, 10), (2, 12), (3, 9), (0, 4)), runs((0, 5), (4, 20), (5, 10), (0, 2))]
COMPLETIONS = [runs((1, 15), (2, 18), (0, 4)), runs((0, 1), (3, 30), (4, 6))]
CASES = {
    # name: (ids, causal, window, softcap, block_q, block_k)
    "self": (layout([[], []], SELF, {}), True, None, None, 16, 16),
    "self_parents_window_softcap": (layout([[], []], SELF, {2: 1, 3: 1, 5: 4}), True, 5, 3.0, 16, 8),
    "prefix_parents_window_softcap": (layout([runs((0, 3), (9, 8)), runs((8, 9), (0, 2))], COMPLETIONS,
                                             {1: 9, 2: 9, 3: 8, 4: 8}), True, 7, 3.0, 8, 16),
    "prefix_own_segment": (layout([runs((0, 4), (1, 7)), runs((0, 11))], COMPLETIONS, {}),
                           True, None, None, 16, 10),
    "not_causal_parents": (layout([runs((0, 3), (9, 8)), runs((8, 11))], COMPLETIONS, {1: 9, 2: 9, 3: 8}),
                           False, None, 3.0, 64, 16),
}


def arrays(ids, seed=0):
    T, S = ids["q_seg"].shape[1], ids["kv_seg"].shape[1]
    rng = np.random.default_rng(seed)
    q = 2.0 * rng.normal(size=(B, T, H, D))  # large enough scores for the soft cap to bend them
    k, v = rng.normal(size=(B, S, K, D)), rng.normal(size=(B, S, K, D))
    cotangent = rng.normal(size=(B, T, H, D))
    return [a.astype(np.float32) for a in (q, k, v, cotangent)]


def kwargs(ids):
    return {"q_segment_ids": ids["q_seg"], "kv_segment_ids": ids["kv_seg"], "q_positions": ids["q_pos"],
            "kv_positions": ids["kv_pos"], "q_parent_ids": ids["q_par"]}


@functools.cache
def run(case: str, impl: str):
    """(output, (dq, dk, dv)) of one case under one implementation, one compile each."""
    ids, causal, window, softcap, block_q, block_k = CASES[case]
    q, k, v, cotangent = arrays(ids)

    @jax.jit
    def f(q, k, v, ct, id_arrays):
        out, pullback = jax.vjp(lambda q, k, v: attend(
            q, k, v, **id_arrays, causal=causal, window=window, softcap=softcap, scale=SCALE, impl=impl,
            block_q=block_q, block_k=block_k), q, k, v)
        return out, pullback(ct)

    out, grads = f(q, k, v, cotangent, kwargs(ids))
    return np.asarray(out), [np.asarray(g) for g in grads]


def expected(case: str):
    ids, causal, window, softcap, _, _ = CASES[case]
    q, k, v, _ = arrays(ids)
    return numpy_attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=SCALE, **ids)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_forward_matches_the_numpy_rule(case, impl):
    np.testing.assert_allclose(run(case, impl)[0], expected(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_chunked_gradients_equal_xla_gradients(case):
    for name, got, want in zip("qkv", run(case, "chunked")[1], run(case, "xla")[1]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("case", ["self_parents_window_softcap", "prefix_own_segment"])
@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_padding_queries_give_exact_zeros_and_finite_gradients(case, impl):
    out, grads = run(case, impl)
    q_seg = CASES[case][0]["q_seg"]
    assert (q_seg == 0).any()
    assert np.all(out[q_seg == 0] == 0.0)
    assert np.all(grads[0][q_seg == 0] == 0.0)  # dq of a query that sees nothing
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_a_traced_window_and_bfloat16_inputs():
    """The window may be a traced scalar (a scanned layer's kind picks it); bf16 inputs give bf16
    outputs and gradients close to the float32 rule."""
    ids, causal, window, softcap, block_q, block_k = CASES["self_parents_window_softcap"]
    q, k, v, cotangent = arrays(ids)

    @jax.jit
    def f(q, k, v, ct, window, id_arrays):
        out, pullback = jax.vjp(lambda q, k, v: attend(
            q, k, v, **id_arrays, causal=causal, window=window, softcap=softcap, scale=SCALE, impl="chunked",
            block_q=block_q, block_k=block_k), q, k, v)
        return out, pullback(ct)

    bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v, cotangent)]
    out, grads = f(*bf16, jnp.int32(window), kwargs(ids))
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected("self_parents_window_softcap"), atol=5e-2)
    want = run("self_parents_window_softcap", "xla")[1]
    for got, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(got, np.float32), w, atol=0.1, rtol=0.05)


def test_chunked_temporaries_stay_below_one_score_matrix():
    """value_and_grad at T = 2048: the chunked path's compiled temporaries stay below one head's
    float32 [T, T] scores, which the XLA path's exceed (so the bound can fail)."""
    T, heads, kv_heads, dim = 2048, 2, 1, 16
    seg = jnp.ones((1, T), jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    bound = T * T * 4

    def temp_bytes(impl):
        def loss(q, k, v, seg, pos):
            return jnp.sum(attend(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos,
                                  scale=0.25, impl=impl, block_q=128, block_k=128))

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        q = jax.ShapeDtypeStruct((1, T, heads, dim), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, T, kv_heads, dim), jnp.float32)
        return f.lower(q, kv, kv, seg, pos).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("chunked") < bound // 4
    assert temp_bytes("xla") > bound


def test_bad_choices_fail_with_the_choices_named():
    ids = CASES["self"][0]
    q, k, v, _ = arrays(ids)
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'.*xla"):
        attend(q, k, v, **kwargs(ids), scale=SCALE, impl="flash")
    with pytest.raises(ValueError, match="interpret=True"):
        attend(q, k, v, **kwargs(ids), scale=SCALE, impl="chunked", interpret=True)
    with pytest.raises(ValueError, match="multiple of K"):
        attend(q[:, :, :3], k, v, **kwargs(ids), scale=SCALE)
    assert IMPLS == ("xla", "chunked", "splash", "gpu")


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_a_model_with_chunked_attention_equals_xla(family):
    # Two 256-token blocks and a ragged third (300 slots), a left-padded row, GQA (qwen3's 4 query
    # heads on 2 kv heads), Gemma's sliding window (40) across block edges: logits and every
    # gradient of the chunked path equal plain XLA's.
    from flax import nnx

    from grpo_jax.models import Transformer
    from grpo_jax.models.presets import tiny

    cfg = tiny(family, **({"sliding_window": 40} if family == "gemma3_text" else {}))
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(3, 256, (2, 300)), jnp.int32)
    mask = jnp.asarray(np.arange(300)[None] >= np.array([[0], [37]]), jnp.int32)
    w = jnp.asarray(rng.normal(size=(2, 300, cfg.vocab_size)), jnp.float32) * mask[..., None]
    out = {}
    for impl in ("xla", "chunked"):
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), attention=impl), nnx.Param)

        @jax.jit
        def loss(params):
            logits = nnx.merge(graphdef, params)(input_ids=ids, attention_mask=mask)
            return jnp.sum(logits * w), logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        out[impl] = (np.asarray(logits)[np.asarray(mask, bool)], nnx.to_flat_state(grads))
    np.testing.assert_allclose(out["chunked"][0], out["xla"][0], atol=1e-5, rtol=1e-5)
    for (path, a), (_, b) in zip(out["xla"][1], out["chunked"][1]):
        # Each gradient sums ~600 tokens x V terms in another order: compared at its own scale.
        a, b = np.asarray(a[...]), np.asarray(b[...])
        assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max() + 1e-6, (path, np.abs(b - a).max(), np.abs(a).max())
