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

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax.engine.pages import PagedCache, write_token
from grpo_jax.engine.routing import layer_experts
from grpo_jax.models.layers import NEG, finish_layer, qkv, rms_norm, rope_tables, softcap
from grpo_jax.runtime.sharding import BATCH

KERNEL_BLOCK_PAGES, KERNEL_BLOCK_QUERIES = 8, 8


def kernel_applies(cfg, dtype, page_size: int) -> bool:
    """Whether the TPU kernel takes this model: head_dim a multiple of 128, 2K heads tileable."""
    packing = 4 // jnp.dtype(dtype).itemsize
    heads = 2 * cfg.num_kv_heads // max(packing, 1)
    return cfg.head_dim % 128 == 0 and (heads in (1, 2, 4, 8) or heads % 8 == 0) and page_size % 8 == 0


def choose_attention(choice: str, cfg, dtype, page_size: int, mesh) -> str:
    """'gather' or 'pallas' for `sampling.paged_attention` on `mesh`'s devices (TPU devices of a
    compile-only topology count as TPU); 'pallas' where the kernel cannot run raises."""
    on_tpu = mesh.devices.flat[0].platform == "tpu"
    if choice == "auto":
        return "pallas" if on_tpu and kernel_applies(cfg, dtype, page_size) else "gather"
    if choice == "pallas" and not on_tpu:
        raise ValueError(f"sampling.paged_attention=pallas runs JAX's TPU kernel, and the mesh's devices are "
                         f"{mesh.devices.flat[0].platform}: use gather (or auto)")
    if choice == "pallas" and not kernel_applies(cfg, dtype, page_size):
        raise ValueError(f"sampling.paged_attention=pallas: the TPU kernel needs head_dim % 128 == 0, a tileable "
                         f"2 x num_kv_heads and page_size % 8 == 0 (head_dim {cfg.head_dim}, {cfg.num_kv_heads} "
                         f"key/value heads, page_size {page_size}); use gather")
    return choice


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


def paged_decode_step(model, tokens_ZJ: jax.Array, cache: PagedCache, write_ZJ: jax.Array, *, phase: jax.Array,
                      phase_columns: tuple[int, ...], impl: str, mesh,
                      weights) -> tuple[jax.Array, PagedCache, jax.Array | None]:
    """Feed each slot's token at key index n + t -> (float32 logits [Z, J, V] of its next token, the
    cache with the token's key/value written into page `write_ZJ` [Z, J] (0 for an empty slot: the
    null page) and slot_t + 1, a mixture-of-experts model's experts of the token int32 [Z, J, L, Kx]
    (None for a dense one)). The gather path reads the first `phase_columns[phase]` table columns
    (each layer switches between the phases' programs, which read the pages but do not carry them);
    the kernel reads each sequence's own pages only, so it has one program."""
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
        else:
            programs[kind] = [functools.partial(_columns, n=n, attend=functools.partial(
                gather_attention, dtype=dtype, **opts)) for n in phase_columns]
    phase = phase if impl != "pallas" else 0
    x_X1E = model.embed_tokens(tokens_ZJ.reshape(X, 1))
    kv, experts = list(cache.kv), []
    for l, kind in enumerate(cfg.layer_types):
        y = cfg.kinds.index(kind)
        q, k, v = qkv(x_X1E, weights[l], cfg, cos_YX1D[y], sin_YX1D[y])  # [X, 1, H, D], [X, 1, K, D]
        kv[l] = write_token(kv[l], write_ZJ, offset_ZJ, k.reshape(Z, J, *k.shape[2:]), v.reshape(Z, J, *v.shape[2:]))
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
