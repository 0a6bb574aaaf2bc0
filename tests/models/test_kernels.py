"""The Pallas attention wrappers (grpo_jax.models.kernels), interpreted on CPU, against a NumPy
reference of the project's visibility rule written here: GQA, packed segments with padding, causal
masking with a key prefix (S > T), a sliding window by positions, soft-capping, ragged lengths;
gradients against a jnp reference, splash under shard_map against one device, and the
features a kernel cannot express raising ValueError."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.config import MeshConfig
from grpo_jax.models import kernels
from grpo_jax.runtime.sharding import AXES, make_mesh

SCALE = 0.3
TOL = 1e-5


def packed(rows: list[list[int]], S: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions int32 [B, S] of rows given as run lengths: a positive run is a
    sequence (ids 1, 2, ... in order, positions counting from 0), a negative run padding (id 0);
    runs are cut at S; what they leave at the end is padding."""
    seg = np.zeros((len(rows), S), np.int32)
    pos = np.zeros((len(rows), S), np.int32)
    for b, runs in enumerate(rows):
        at, next_id = 0, 1
        for run in runs:
            end = min(at + abs(run), S)
            if run > 0:
                seg[b, at:end], pos[b, at:end] = next_id, np.arange(end - at)
                next_id += 1
            at += abs(run)
    return seg, pos


def reference(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, causal=True, window=None, softcap=None, q_parent=None):
    """The visibility rule and softmax in float64; [B, T, H, D]."""
    _, T, H, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    k, v = (np.repeat(np.asarray(x, np.float64), H // K, axis=2) for x in (k, v))
    s = np.einsum("bthd,bshd->bhts", np.asarray(q, np.float64), k) * SCALE
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    same = kv_seg[:, None, :] == q_seg[:, :, None]
    if q_parent is not None:
        same |= kv_seg[:, None, :] == q_parent[:, :, None]
    visible = (kv_seg[:, None, :] != 0) & same
    if causal:
        visible &= np.arange(S)[None, None, :] <= np.arange(T)[None, :, None] + (S - T)
    if window is not None:
        visible &= q_pos[:, :, None] - kv_pos[:, None, :] < window
    s = np.where(visible[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-30)
    return np.einsum("bhts,bshd->bthd", p, v)


def inputs(rows, *, T, S, H=4, K=2, D=32, seed=0):
    """Random q [B, T, H, D], k, v [B, S, K, D] (float32) and the keyword arguments of a wrapper for
    packed rows over S key slots whose last T are the queries."""
    rng = np.random.default_rng(seed)
    kv_seg, kv_pos = packed(rows, S)
    B = len(rows)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((B, T, H, D), (B, S, K, D), (B, S, K, D)))
    kw = {"q_segment_ids": kv_seg[:, S - T:], "kv_segment_ids": kv_seg, "q_positions": kv_pos[:, S - T:],
              "kv_positions": kv_pos}
    return q, k, v, kw


def max_error(out, ref, q_seg) -> float:
    out = np.asarray(out)
    assert np.isfinite(out).all()  # padding queries too
    return float(np.abs(out - ref)[q_seg != 0].max())


ROWS = [[100, 60, 70], [-30, 90, 1, 100]]  # three sequences + padding; left padding, a 1-token sequence


@pytest.mark.parametrize("case", [
    {"T": 256, "S": 256, "causal": True},
    {"T": 128, "S": 256, "causal": True, "window": 48, "softcap": 2.0},  # a prefix, the window by positions
    {"T": 200, "S": 231, "causal": True, "window": 17},  # ragged lengths: padded to blocks internally
    {"T": 256, "S": 256, "causal": False, "softcap": 1.5},
    {"T": 128, "S": 256, "causal": False, "window": 30},  # the window bounds one side only
], ids=["causal", "prefix-window-softcap", "ragged-window", "noncausal-softcap", "noncausal-window"])
def test_splash_matches_the_reference(case):
    T, S = case["T"], case["S"]
    case = {name: value for name, value in case.items() if name not in ("T", "S")}
    q, k, v, kw = inputs(ROWS, T=T, S=S)
    out = kernels.splash_attention(q, k, v, **kw, **case, scale=SCALE, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference(q, k, v, kw["q_segment_ids"], kw["kv_segment_ids"], kw["q_positions"], kw["kv_positions"],
                    **case)
    err = max_error(out, ref, kw["q_segment_ids"])
    print(f"splash {T}x{S} {case}: max error {err:.2e}")
    assert err < TOL


def test_splash_keeps_bfloat16():
    q, k, v, kw = inputs(ROWS, T=128, S=256)
    out = kernels.splash_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), **kw, window=64, scale=SCALE,
                                   interpret=True)
    assert out.dtype == jnp.bfloat16
    ref = reference(q, k, v, kw["q_segment_ids"], kw["kv_segment_ids"], kw["q_positions"], kw["kv_positions"],
                    window=64)
    assert max_error(out.astype(jnp.float32), ref, kw["q_segment_ids"]) < 3e-2  # bf16 inputs and output


@pytest.mark.parametrize("T,causal", [(128, True), (100, True), (128, False)])
def test_gpu_kernel_matches_the_reference(T, causal):
    q, k, v, kw = inputs([[50, 40, 20], [-10, 60, 1, 30]], T=T, S=T)
    out = kernels.gpu_attention(q, k, v, **kw, causal=causal, scale=SCALE, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference(q, k, v, kw["q_segment_ids"], kw["kv_segment_ids"], kw["q_positions"], kw["kv_positions"],
                    causal=causal)
    err = max_error(out, ref, kw["q_segment_ids"])
    print(f"gpu T={T} causal={causal}: max error {err:.2e}")
    assert err < TOL


def jnp_reference(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, window=None, softcap=None):
    """The rule in jnp (causal, S == T) for gradients; fully masked (padding) rows are finite."""
    H, K = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) * SCALE
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    T = q.shape[1]
    visible = ((kv_seg[:, None, :] != 0) & (kv_seg[:, None, :] == q_seg[:, :, None])
               & (jnp.arange(T)[None, None, :] <= jnp.arange(T)[None, :, None]))
    if window is not None:
        visible &= q_pos[:, :, None] - kv_pos[:, None, :] < window
    p = jax.nn.softmax(jnp.where(visible[:, None], s, -1e30), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v)


@pytest.mark.parametrize("impl,opts", [("splash", {"window": 33, "softcap": 2.0}), ("gpu", {})])
def test_gradients_match_the_reference(impl, opts):
    wrapper = {"splash": kernels.splash_attention, "gpu": kernels.gpu_attention}[impl]
    q, k, v, kw = inputs([[60, 40, 20], [-10, 80, 1, 30]], T=128, S=128, seed=1)
    real = (kw["q_segment_ids"] != 0)[:, :, None, None]
    cotangent = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32) * real  # padding unread
    out, vjp = jax.vjp(lambda q, k, v: wrapper(q, k, v, **kw, **opts, scale=SCALE, interpret=True), q, k, v)
    ref_out, ref_vjp = jax.vjp(lambda q, k, v: jnp_reference(q, k, v, *kw.values(), **opts), q, k, v)
    assert max_error(out, np.asarray(ref_out), kw["q_segment_ids"]) < TOL
    for name, got, want in zip("qkv", vjp(cotangent), ref_vjp(cotangent)):
        err = float(jnp.abs(got - want).max())
        print(f"{impl} d{name}: max error {err:.2e}")
        assert err < TOL, name


@pytest.mark.parametrize("mesh_of", [
    lambda: jax.make_mesh((2, 1, 1, 1), AXES),  # Explicit axes (jax's default)
    lambda: make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4]),  # the project's (Auto), heads split
    lambda: make_mesh(MeshConfig(data=1, fsdp=2, tensor=4), jax.devices()),  # 4 does not divide K=2: heads whole
], ids=["2x1x1-explicit", "2x1x2-auto", "1x2x4-auto"])
def test_splash_on_a_mesh_equals_one_device(mesh_of):
    q, k, v, kw = inputs(ROWS, T=128, S=256)
    opts = {"window": 40, "softcap": 2.0, "scale": SCALE, "interpret": True}
    cotangent = np.random.default_rng(3).standard_normal(q.shape).astype(np.float32)

    def loss(q, k, v, kw, mesh):
        return (kernels.splash_attention(q, k, v, **kw, **opts, mesh=mesh) * cotangent).sum()

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    (want, want_grads), (got, got_grads) = grad(q, k, v, kw, None), jax.jit(grad, static_argnums=4)(q, k, v, kw, mesh_of())
    assert float(jnp.abs(got - want)) < 1e-4
    for got_grad, want_grad in zip(got_grads, want_grads):
        assert float(jnp.abs(got_grad - want_grad).max()) < 1e-6


def test_unsupported_features_raise():
    q, k, v, kw = inputs([[60, 40]], T=128, S=128)
    with pytest.raises(ValueError, match="parent ids"):
        kernels.splash_attention(q, k, v, **kw, q_parent_ids=kw["q_segment_ids"], scale=SCALE, interpret=True)
    for feature, extra in {"parent ids": {"q_parent_ids": kw["q_segment_ids"]}, "sliding window": {"window": 8},
                           "soft-capping": {"softcap": 2.0}}.items():
        with pytest.raises(ValueError, match=feature):
            kernels.gpu_attention(q, k, v, **kw, **extra, scale=SCALE, interpret=True)
    different = {**kw, "kv_segment_ids": np.where(kw["kv_segment_ids"] == 2, 3, kw["kv_segment_ids"])}
    with pytest.raises(ValueError, match="differ"):
        kernels.gpu_attention(q, k, v, **different, scale=SCALE, interpret=True)
    q, k, v, kw = inputs([[60, 40]], T=64, S=128)
    with pytest.raises(ValueError, match="S=128 != T=64"):
        kernels.gpu_attention(q, k, v, **kw, scale=SCALE, interpret=True)
    assert kernels.supports("splash") == {"window", "softcap", "prefix"} and kernels.supports("gpu") == frozenset()
    assert kernels.supports("splash") <= kernels.FEATURES
    mesh = jax.make_mesh((2, 1, 1, 1), AXES)
    with pytest.raises(ValueError, match="rows do not split"):
        kernels.splash_attention(q, k, v, **kw, scale=SCALE, mesh=mesh, interpret=True)
