"""One decode step of the paged engine: every slot feeds one token, writes its key/value into its
page, and attends over its own pages (grpo_jax.engine.pages).

Two ways to attend, the same numbers:
- `gather_attention` (any backend, and the reference): each slot's first `columns` pages are
  gathered into one key block [X, columns x Sg, 2K, D] and masked past the slot's length (and
  outside a sliding window). The engine picks `columns` from the longest sequence in flight (phases,
  as the slot engine), so steps while everything is short do not read the whole table.
- `kernel_attention`: JAX's TPU Pallas kernel `ragged_paged_attention`, one call per layer under
  `shard_map` over the row shards (each shard attends its own pages). It needs head_dim % 128 == 0
  and a tileable 2K; `paged_attention: auto` takes it on TPU where it applies.

Shape letters: grpo_jax.shapes (Z row shards, J slots, X = Z*J, Sg tokens per page, Tb columns).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax.engine.pages import PagedCache, write_token
from grpo_jax.engine.routing import layer_experts
from grpo_jax.models.dispatch import model_need, pick
from grpo_jax.models.layers import NEG, finish_layer, qkv, rms_norm, rope_tables, softcap
from grpo_jax.runtime.platform import interpret_kernels, platform_of
from grpo_jax.runtime.sharding import BATCH

KERNEL_BLOCK_PAGES, KERNEL_BLOCK_QUERIES = 8, 8


def choose_attention(choice: str, cfg, dtype, page_size: int, mesh) -> str:
    """The decode step's implementation for `sampling.paged_attention` on `mesh`'s platform
    (grpo_jax.models.dispatch.DECODE: "gather", "pallas" the TPU kernel, "gpu" the GPU kernel; TPU
    devices of a compile-only topology count as TPU); an explicit one that cannot run here raises
    ValueError naming one that can."""
    need = dataclasses.replace(model_need("decode", cfg, platform_of(mesh)), page_size=page_size,
                               dtype_bytes=jnp.dtype(dtype).itemsize)
    return pick(choice, need)


def gather_attention(q_XHD, pages: tuple[jax.Array, jax.Array], table_ZJT, len_ZJ, *, window: int | None,
                     scale: float, cap: float | None, dtype) -> jax.Array:
    """One query per slot over its pages: q [X, H, D] (the token at key index len - 1), pages in the
    split layout (keys [Z, Pg, K, D, Sg], values [Z, Pg, K, Sg, D]), table [Z, J, Tb], len [Z, J]
    keys including this token -> [X, H, D]. Scores and outputs are batched per (slot, page, head),
    so the gathered pages are read in place; the softmax runs over every page's keys at once."""
    keys, values = pages
    Z, J, T = table_ZJT.shape
    K, D, Sg = keys.shape[2:]
    X, H = Z * J, q_XHD.shape[1]
    k_XTKDS = jax.vmap(lambda a, t: a[t])(keys, table_ZJT).reshape(X, T, K, D, Sg).astype(dtype)
    v_XTKSD = jax.vmap(lambda a, t: a[t])(values, table_ZJT).reshape(X, T, K, Sg, D).astype(dtype)
    q_XTKQD = jnp.broadcast_to(q_XHD.reshape(X, 1, K, H // K, D), (X, T, K, H // K, D))
    s = jnp.einsum("xtkqd,xtkds->xtkqs", q_XTKQD, k_XTKDS, preferred_element_type=jnp.float32)
    s = softcap(s * scale, cap)
    j_TS, n_X = jnp.arange(T * Sg).reshape(T, Sg), len_ZJ.reshape(X)
    mask = j_TS[None] < n_X[:, None, None]
    if window is not None:
        mask &= (n_X[:, None, None] - 1) - j_TS[None] < window
    s = jnp.where(mask[:, :, None, None, :], s, NEG)
    e = jnp.exp(s - s.max(axis=(1, 4), keepdims=True))
    o_XKQD = jnp.einsum("xtkqs,xtksd->xtkqd", e.astype(dtype), v_XTKSD, preferred_element_type=jnp.float32).sum(1)
    return (o_XKQD / e.sum(axis=(1, 4))[..., None]).reshape(X, H, D)


def kernel_attention(q_XHD, pages: tuple[jax.Array], table_ZJT, len_ZJ, *, window: int | None, scale: float,
                     cap: float | None, mesh) -> jax.Array:
    """`gather_attention` by JAX's TPU kernel over the interleaved layout (pages [Z, Pg, Sg, 2K, D]),
    each row shard's slots over its own pages."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    Z, J, T = table_ZJT.shape

    def shard(q_XHD, kv_ZPSKD, table_ZJT, len_ZJ):
        Jl = table_ZJT.shape[0] * table_ZJT.shape[1]
        # The kernel sets its own matmul precision; a process-wide "highest" makes Mosaic refuse bf16
        # operands ("Bad lhs type").
        with jax.default_matmul_precision("default"):
            return ragged_paged_attention(
                q_XHD, kv_ZPSKD.reshape(-1, *kv_ZPSKD.shape[2:]), len_ZJ.reshape(Jl),
                table_ZJT.reshape(Jl, T), jnp.arange(Jl + 1, dtype=jnp.int32), jnp.array([Jl], jnp.int32),
                sm_scale=scale, sliding_window=window, soft_cap=cap,
                num_kv_pages_per_block=min(KERNEL_BLOCK_PAGES, T), num_queries_per_block=KERNEL_BLOCK_QUERIES)

    rows = PartitionSpec(BATCH)
    return jax.shard_map(shard, mesh=mesh, in_specs=(rows, rows, rows, rows), out_specs=rows,
                         check_vma=False)(q_XHD, pages[0], table_ZJT, len_ZJ)


GPU_BLOCK_H = 16  # query heads per kv head per program (the kernel's minimum; fewer are padded)
GPU_BLOCK_PAGES = 8  # pages per compute block (the kernel's default)
GPU_MAX_SPLITS = 16  # partitions of a sequence's pages, each its own program (the kernel's default)


def gpu_split(columns: int) -> tuple[int, int, int]:
    """(pages per compute block, partitions, table columns padded to partitions x a multiple of
    the block) for a table of `columns` columns: the kernel splits a sequence's pages into equal
    partitions of whole compute blocks; the padding columns are past every length, never read."""
    block = min(GPU_BLOCK_PAGES, columns)
    splits = min(GPU_MAX_SPLITS, -(-columns // block))
    per = -(-columns // (splits * block)) * block
    return block, splits, splits * per


def gpu_kernel_attention(q_XHD, pages: tuple[jax.Array, jax.Array], table_ZJT, len_ZJ, *, window: int | None,
                         scale: float, cap: float | None, mesh, interpret: bool = False) -> jax.Array:
    """`gather_attention` by JAX's Pallas GPU kernel (`jax.experimental.pallas.ops.gpu.paged_attention`'s
    kernel body) over the "heads" layout (keys and values [Z, Pg, K, Sg, D]): each sequence reads its
    own pages in place, up to its length, one key/value head per program, split into partitions
    whose partial softmaxes are merged after (flash decoding). Under shard_map over the row shards.
    The kernel has no sliding window (`dispatch.DECODE` refuses it for such models)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu.paged_attention import DEFAULT_MASK_VALUE, paged_attention_kernel

    if window is not None:
        raise ValueError("the GPU paged kernel has no sliding window: use sampling.paged_attention=gather")
    Z, J, T = table_ZJT.shape
    block, splits, padded = gpu_split(T)
    per = padded // splits

    def one(q_HD, keys_PKSD, values_PKSD, table_T, len_1):
        H, D = q_HD.shape
        _, K, Sg, _ = keys_PKSD.shape
        Q = H // K
        Qp = -(-Q // GPU_BLOCK_H) * GPU_BLOCK_H
        q_KQD = jnp.pad((q_HD * scale).reshape(K, Q, D), ((0, 0), (0, Qp - Q), (0, 0)))
        kernel = functools.partial(paged_attention_kernel, num_heads=Q, pages_per_compute_block=block,
                                   mask_value=DEFAULT_MASK_VALUE, attn_logits_soft_cap=cap)
        pages_spec = pl.BlockSpec((keys_PKSD.shape[0], None, Sg, D), lambda h, i, k: (0, h, 0, 0))
        o, l, m = pl.pallas_call(
            lambda q, k, v, t, n, *out: kernel(q, k, None, v, None, t, n, *out),
            grid=(K, Qp // GPU_BLOCK_H, splits),
            in_specs=[pl.BlockSpec((None, GPU_BLOCK_H, D), lambda h, i, k: (h, i, 0)), pages_spec, pages_spec,
                      pl.BlockSpec((None, per), lambda h, i, k: (k, 0)), pl.BlockSpec((1,), lambda h, i, k: (0,))],
            out_specs=[pl.BlockSpec((None, None, GPU_BLOCK_H, D), lambda h, i, k: (k, h, i, 0)),
                       pl.BlockSpec((None, None, GPU_BLOCK_H), lambda h, i, k: (k, h, i)),
                       pl.BlockSpec((None, None, GPU_BLOCK_H), lambda h, i, k: (k, h, i))],
            out_shape=[jax.ShapeDtypeStruct((splits, K, Qp, D), jnp.float32),
                       jax.ShapeDtypeStruct((splits, K, Qp), jnp.float32),
                       jax.ShapeDtypeStruct((splits, K, Qp), jnp.float32)],
            interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            name="grpo_jax_paged_decode",
        )(q_KQD, keys_PKSD, values_PKSD, table_T.reshape(splits, per), len_1)
        m_next = m.max(axis=0)  # the partitions' softmaxes merged
        correction = jnp.exp(m - m_next[None])
        total = (l * correction).sum(axis=0)
        o_KQD = (o * correction[..., None]).sum(axis=0) / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]
        return o_KQD[:, :Q].reshape(H, D)

    def shard(q_XHD, keys_ZPKSD, values_ZPKSD, table_ZJT, len_ZJ):
        Jl = table_ZJT.shape[0] * table_ZJT.shape[1]
        table = jnp.pad(table_ZJT.reshape(Jl, T), ((0, 0), (0, padded - T)))
        keys, values = keys_ZPKSD[0], values_ZPKSD[0]  # one shard's pages
        run = jax.vmap(lambda q, t, n: one(q, keys, values, t, n))
        return run(q_XHD.astype(keys.dtype), table, len_ZJ.reshape(Jl, 1).astype(jnp.int32))

    rows = PartitionSpec(BATCH)
    return jax.shard_map(shard, mesh=mesh, in_specs=(rows,) * 5, out_specs=rows,
                         check_vma=False)(q_XHD, *pages, table_ZJT, len_ZJ)


def paged_decode_step(model, tokens_ZJ: jax.Array, cache: PagedCache, write_ZJ: jax.Array, *, phase: jax.Array,
                      phase_columns: tuple[int, ...], impl: str, mesh,
                      weights) -> tuple[jax.Array, PagedCache, jax.Array | None]:
    """Feed each slot's token at key index n + t -> (float32 logits [Z, J, V] of its next token, the
    cache with the token's key/value written into page `write_ZJ` [Z, J] (0 for an empty slot: the
    null page) and slot_t + 1, a mixture-of-experts model's experts of the token int32 [Z, J, L, Kx]
    (None for a dense one)). The gather path reads the first `phase_columns[phase]` table columns
    (each layer switches between the phases' programs, which read the pages but do not carry them);
    the kernels ("pallas" on TPU, "gpu") read each sequence's own pages only, so they have one program."""
    cfg, dtype = model.config, model.dtype
    Z, J = tokens_ZJ.shape
    X, Sg = Z * J, cache.page_size
    pos_ZJ = cache.slot_len()
    cos_YX1D, sin_YX1D = rope_tables(cfg, pos_ZJ.reshape(X, 1), dtype)
    offset_ZJ = jnp.where(write_ZJ > 0, pos_ZJ % Sg, 0)
    programs = {}
    for kind in cfg.kinds:
        opts = dict(window=cfg.window_of(kind), scale=cfg.query_scale, cap=cfg.attn_logit_softcap)
        if impl == "pallas":
            programs[kind] = [functools.partial(_columns, n=cache.columns, attend=functools.partial(
                kernel_attention, mesh=mesh, **opts))]
        elif impl == "gpu":
            programs[kind] = [functools.partial(_columns, n=cache.columns, attend=functools.partial(
                gpu_kernel_attention, mesh=mesh, interpret=interpret_kernels(mesh), **opts))]
        else:
            programs[kind] = [functools.partial(_columns, n=n, attend=functools.partial(
                gather_attention, dtype=dtype, **opts)) for n in phase_columns]
    phase = phase if impl == "gather" else 0
    x_X1E = model.embed_tokens(tokens_ZJ.reshape(X, 1))
    kv, experts = list(cache.kv), []
    for l, kind in enumerate(cfg.layer_types):
        y = cfg.kinds.index(kind)
        q, k, v = qkv(x_X1E, weights[l], cfg, cos_YX1D[y], sin_YX1D[y])  # [X, 1, H, D], [X, 1, K, D]
        kv[l] = write_token(kv[l], write_ZJ, offset_ZJ, k.reshape(Z, J, *k.shape[2:]), v.reshape(Z, J, *v.shape[2:]),
                            layout=cache.layout)
        o_XHD = jax.lax.switch(phase, programs[kind], q[:, 0], kv[l], cache.table, pos_ZJ + 1)
        x_X1E, routed = finish_layer(x_X1E, o_XHD.reshape(X, 1, *o_XHD.shape[1:]).astype(dtype), weights[l], cfg,
                                     mesh=mesh)
        experts.append(routed)
    logits_XV = model.logits(rms_norm(x_X1E, model.final_norm[...], cfg))[:, 0]
    return (logits_XV.reshape(Z, J, -1), cache.replace(kv=tuple(kv), slot_t=cache.slot_t + 1),
            layer_experts(experts, (Z, J)))


def _columns(q_XHD, kv_ZPSKD, table_ZJT, len_ZJ, *, n: int, attend) -> jax.Array:
    """`attend` over the first n table columns."""
    return attend(q_XHD, kv_ZPSKD, table_ZJT[:, :, :n], len_ZJ)
