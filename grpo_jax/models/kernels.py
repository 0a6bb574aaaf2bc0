"""JAX's own Pallas attention kernels behind the attention dispatcher's signature
(`grpo_jax.models.attention`): `splash_attention` (TPU: `jax.experimental.pallas.ops.tpu.
splash_attention`) and `gpu_attention` (GPU: `jax.experimental.pallas.ops.gpu.attention.mha`, the
Triton flash kernel). Both run on CPU with `interpret=True` (the tests).

Shapes follow grpo_jax.shapes: queries [B, T, H, D], keys and values [B, S, K, D] with S >= T (the
queries are the last T key slots), query head h reading kv head h // (H // K). The visibility rule
is the project's: key s is visible to query t iff kv_seg[s] != 0 and kv_seg[s] equals q_seg[t] (or
q_parent[t]), and (causal) s <= t + (S - T), and (window) q_pos[t] - kv_pos[s] < window; scores are
q.k * scale, soft-capped (`softcap * tanh(score / softcap)`), masked, then softmaxed. Outputs of
padding queries (q_seg 0) are finite and meaningless.

What each kernel can express is in `supports`; a wrapper asked for anything else raises ValueError
naming it, so the dispatcher can choose another implementation instead of getting a wrong mask.

Neither kernel reads positions: a sliding window is applied by index distance, which is the
position distance when positions count up by one inside each segment and query index t sits at key
index t + (S - T) (packed rows from `segment_positions`, left-padded rows, a cache prefix followed
by its continuation). Rows laid out otherwise must use another implementation.

Mosaic and Triton kernels cannot be partitioned by jit's sharding propagation, so with a `mesh` the
kernel runs under `jax.shard_map`: rows split over the mesh's batch axes (grpo_jax.runtime.sharding
.BATCH), heads over `tensor` where it divides both H and K (else every `tensor` device computes all
heads of its rows: correct, redundant).
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import attention as gpu_mha
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.runtime.sharding import BATCH

FEATURES = frozenset({"parents", "window", "softcap", "prefix"})
"""Attention features beyond causal masking over segment ids (with GQA and padding), which every
wrapper here has: `parents` (a query also sees its parent segment: packed completions sharing one
prompt), `window` (sliding window), `softcap` (tanh soft-capping of the scores), `prefix` (S != T:
keys before the queries, e.g. a cached prompt)."""

_SUPPORTED = {
    "splash": frozenset({"window", "softcap", "prefix"}),
    "gpu": frozenset(),
}

LANES = 128
"""Splash's lengths are whole blocks of 128 (its segment-id and kv tiles are 128 lanes wide);
shorter or ragged lengths are padded here with segment-0 slots and the padding sliced off."""

SPLASH_BLOCKS = (512, 256, 128)
"""Splash's block sizes, largest first: a padded length uses the largest that divides it (MaxText's
default is 512 throughout)."""


def supports(impl: str) -> frozenset[str]:
    """The `FEATURES` the wrapper `impl` ("splash" or "gpu") can express."""
    if impl not in _SUPPORTED:
        raise ValueError(f"unknown kernel {impl!r}: one of {sorted(_SUPPORTED)}")
    return _SUPPORTED[impl]


def splash_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, q_segment_ids: jax.Array,
                     kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                     q_parent_ids: jax.Array | None = None, causal: bool = True, window: int | None = None,
                     softcap: float | None = None, scale: float, mesh: jax.sharding.Mesh | None = None,
                     interpret: bool = False) -> jax.Array:
    """Attention [B, T, H, D] of queries [B, T, H, D] over keys and values [B, S, K, D] (segment ids
    int [B, T] and [B, S], 0 = padding) with the TPU splash kernel, one row at a time (vmap).

    Supports GQA, causal masking with S >= T, a sliding `window` (by index distance: see the module
    docstring; positions are not read), `softcap`. Parent ids cannot be expressed with the kernel's
    equality segment ids: ValueError. Lengths are padded to whole blocks of 128 internally. `mesh`:
    run under shard_map (rows over data x fsdp x expert, heads over tensor). Differentiable (the kernel's own
    custom vjp: a dk/dv kernel and a dq kernel, memory linear in the length).
    """
    del q_positions, kv_positions  # the window is index distance (module docstring)
    _check(q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, impl="splash", parents=q_parent_ids,
           window=window, softcap=softcap)
    T, S = q_BTHD.shape[1], k_BSKD.shape[1]
    run = functools.partial(_splash_rows, offset=S - T, causal=causal, window=window, softcap=softcap, scale=scale,
                            interpret=interpret)
    return _on_mesh(run, mesh, q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids)


def gpu_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, q_segment_ids: jax.Array,
                  kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
                  q_parent_ids: jax.Array | None = None, causal: bool = True, window: int | None = None,
                  softcap: float | None = None, scale: float, mesh: jax.sharding.Mesh | None = None,
                  interpret: bool = False) -> jax.Array:
    """Attention [B, T, H, D] of queries [B, T, H, D] over keys and values [B, T, K, D] with JAX's
    Pallas GPU (Triton) flash kernel.

    The kernel takes one segment-id array for queries and keys and masks causally by index, so it
    needs S == T and equal query and key segment ids (checked when they are concrete; a plain pass
    has them equal); parents, a window, soft-capping and S != T raise ValueError. GQA: the kernel
    has no kv-head mapping, so keys and values are repeated to H heads here (H // K times their
    memory). Lengths are padded internally (to a power of two up to 128, whole 128s above).
    `mesh`: run under shard_map as splash does. Differentiable (the kernel's custom vjp).

    Why not `jax.nn.dot_product_attention(implementation="cudnn")`: it has no segment ids (only
    per-row lengths), so packed rows could not use it; this kernel also runs interpreted on CPU.
    """
    del q_positions, kv_positions  # no window: positions are not needed
    _check(q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, impl="gpu", parents=q_parent_ids, window=window,
           softcap=softcap)
    concrete = not isinstance(q_segment_ids, jax.core.Tracer) and not isinstance(kv_segment_ids, jax.core.Tracer)
    if concrete and not np.array_equal(np.asarray(q_segment_ids), np.asarray(kv_segment_ids)):
        raise ValueError("gpu_attention: the kernel takes one segment-id array for queries and keys, but "
                         "q_segment_ids and kv_segment_ids differ; use another attention implementation")
    run = functools.partial(_gpu_rows, causal=causal, scale=scale, interpret=interpret)
    return _on_mesh(run, mesh, q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids)


def _check(q_BTHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, *, impl, parents, window, softcap) -> None:
    """Shapes, then the features `impl` cannot express (ValueError naming them)."""
    chex.assert_rank([q_BTHD, k_BSKD, v_BSKD], 4)
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    chex.assert_shape([k_BSKD, v_BSKD], (B, S, K, D))
    chex.assert_shape(q_segment_ids, (B, T))
    chex.assert_shape(kv_segment_ids, (B, S))
    if H % K:
        raise ValueError(f"{impl} attention: {H} query heads are not a multiple of {K} kv heads")
    if S < T:
        raise ValueError(f"{impl} attention: {S} key slots < {T} queries; the queries must be the last T keys")
    if window is not None and window < 1:
        raise ValueError(f"{impl} attention: window={window} must be >= 1 (None: no window)")
    asked = {"parents": parents is not None, "window": window is not None, "softcap": softcap is not None,
             "prefix": S != T}
    missing = sorted(f for f, on in asked.items() if on and f not in supports(impl))
    if missing:
        why = {"parents": "parent ids (packed completions sharing a prompt; the kernel's segment ids match "
                          "by equality only: lay packed sequences out without shared prompts)",
               "window": "a sliding window", "softcap": "logit soft-capping",
               "prefix": f"keys before the queries (S={S} != T={T})"}
        raise ValueError(f"{impl} attention does not support " + "; ".join(why[f] for f in missing)
                         + ": choose another attention implementation")


def _on_mesh(run, mesh, q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS) -> jax.Array:
    """`run(q, k, v, q_seg, kv_seg)` on the whole arrays, or per shard under shard_map over `mesh`
    (a Mosaic or Triton kernel cannot be partitioned by jit)."""
    if mesh is None:
        return run(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS)
    B, _, H, _ = q_BTHD.shape
    K = k_BSKD.shape[2]
    row_shards = math.prod(mesh.shape[a] for a in BATCH)
    if B % row_shards:
        raise ValueError(f"attention kernel on a mesh: {B} rows do not split over data x fsdp x expert = {row_shards} "
                         "shards; make the batch a multiple of it")
    tensor = mesh.shape["tensor"]
    heads = "tensor" if H % tensor == 0 and K % tensor == 0 else None
    x_spec, seg_spec = P(BATCH, None, heads, None), P(BATCH, None)
    specs = (x_spec, x_spec, x_spec, seg_spec, seg_spec)
    args = (q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS)
    if AxisType.Explicit in mesh.axis_types:  # sharding in the types: shard_map asks them to match its specs
        args = tuple(jax.sharding.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip(args, specs))
    # check_vma off: pallas_call has no replication rule; the specs above say what is split.
    return jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=x_spec, check_vma=False)(*args)


def _pad_axis1(x: jax.Array, size: int) -> jax.Array:
    """`x` zero-padded at the end of axis 1 to `size` (segment id 0 = padding)."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, size - x.shape[1])
    return jnp.pad(x, pad) if size != x.shape[1] else x


def splash_lengths(T: int, S: int) -> tuple[int, int]:
    """The padded (T, S) the splash kernel runs: whole blocks of `LANES`, with at least as many
    padding keys as padding queries so that every padded query keeps its own key slot t + (S - T)
    inside the key axis (a query row with no computed block would divide 0 by 0)."""
    Tp, Sp = -(-T // LANES) * LANES, -(-S // LANES) * LANES
    if Tp - T > Sp - S:
        Sp += LANES
    return Tp, Sp


def _block(n: int) -> int:
    return next(b for b in SPLASH_BLOCKS if n % b == 0)


def _splash_kernel(H: int, Tp: int, Sp: int, offset: int, causal: bool, window: int | None, softcap: float | None,
                   interpret: bool):
    """The splash kernel for H heads of one row. Made per trace: it holds its mask information as
    arrays, which would leak from a trace if kept (splash caches the NumPy mask processing itself)."""
    shape = (Tp, Sp)
    left = None if window is None else window - 1  # q_pos - kv_pos < window: at most window - 1 back
    if window is not None:
        mask = splash.LocalMask(shape, (left, 0 if causal else None), offset)
    elif causal:
        mask = splash.CausalMask(shape, offset)
    else:
        mask = splash.FullMask(shape)
    bq, bkv = _block(Tp), _block(Sp)
    # The backward runs dq in a kernel of its own (two kernels, as MaxText's default). The fused
    # backward computes dq inside the dk/dv kernel as one partial per key block, summed afterwards:
    # a [Sp / bkv, H, Tp, D] array per row, quadratic in the length (Qwen3-0.6B's train step at 8,192
    # tokens on v5e-8: 8 rows x 33 blocks x 16 heads x 8,192 x 128 = 8.25 GiB per chip, and XLA:TPU
    # refused it at 16.28 GiB of temporaries).
    blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                               block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv, use_fused_bwd_kernel=False)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * H), block_sizes=blocks, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)


def _splash_rows(q_BTHD, k_BSKD, v_BSKD, q_seg_BT, kv_seg_BS, *, offset, causal, window, softcap, scale, interpret):
    """Splash over rows (vmap), padded to whole blocks; heads are whatever this shard holds."""
    _, T, H, _ = q_BTHD.shape
    Tp, Sp = splash_lengths(T, k_BSKD.shape[1])
    # The kernel does not scale: scale q in float32 before rounding back to its dtype.
    q = (q_BTHD.astype(jnp.float32) * scale).astype(q_BTHD.dtype)
    q_BHTD = jnp.swapaxes(_pad_axis1(q, Tp), 1, 2)
    k_BKSD = jnp.swapaxes(_pad_axis1(k_BSKD, Sp), 1, 2)
    v_BKSD = jnp.swapaxes(_pad_axis1(v_BSKD, Sp), 1, 2)
    segments = splash.SegmentIds(q=_pad_axis1(q_seg_BT.astype(jnp.int32), Tp),
                                 kv=_pad_axis1(kv_seg_BS.astype(jnp.int32), Sp))
    kernel = _splash_kernel(H, Tp, Sp, offset, causal, window, softcap, interpret)
    out_BHTD = jax.vmap(kernel)(q_BHTD, k_BKSD, v_BKSD, segment_ids=segments)
    return jnp.swapaxes(out_BHTD, 1, 2)[:, :T]


def gpu_length(T: int) -> int:
    """The padded length the GPU kernel runs: Triton tiles are powers of two (at least 16), its
    blocks 128 long."""
    return max(16, 1 << (T - 1).bit_length()) if T <= 128 else -(-T // 128) * 128


def _gpu_rows(q_BTHD, k_BTKD, v_BTKD, q_seg_BT, kv_seg_BT, *, causal, scale, interpret):
    """The Triton kernel over this shard's rows and heads, keys repeated to the query heads."""
    del q_seg_BT  # equal to kv_seg_BT (gpu_attention)
    _, T, H, _ = q_BTHD.shape
    Q = H // k_BTKD.shape[2]
    k_BTHD, v_BTHD = (jnp.repeat(x, Q, axis=2) if Q > 1 else x for x in (k_BTKD, v_BTKD))
    Tp = gpu_length(T)
    out = gpu_mha.mha(_pad_axis1(q_BTHD, Tp), _pad_axis1(k_BTHD, Tp), _pad_axis1(v_BTHD, Tp),
                      _pad_axis1(kv_seg_BT.astype(jnp.int32), Tp), sm_scale=scale, causal=causal, interpret=interpret)
    return out[:, :T]
