"""The paged engine's key/value cache: a pool of fixed-size pages per row shard, a page table per
decode slot, and the allocator that hands pages out and takes them back, all on device
(grpo_jax.engine.paged runs the loop; grpo_jax.engine.paged_decode attends over the pages).

Layout, per row shard (every index is local to its shard, as in `engine.slots`):
- `kv`: per layer, the pages in one of three layouts (`LAYOUTS`, by the decode step's attention),
  page id on axis 1 of every array: "interleaved", one array [Z, Pg, Sg, 2K, D] with key and value
  heads interleaved on the third axis (even = key head k/2, odd = value head), the layout of JAX's
  TPU kernel `ragged_paged_attention`; "split", keys [Z, Pg, K, D, Sg] and values [Z, Pg, K, Sg, D],
  what the gather path reads without a transpose (on XLA:CPU a decode step's attention took half
  the time of the interleaved layout's: 3.3 against 6.9 ms per layer at 32 slots x 320 keys);
  "heads", keys and values [Z, Pg, K, Sg, D], what the GPU kernel reads one key/value head at a
  time (grpo_jax.engine.paged_decode.gpu_kernel_attention). One page id covers every layer.
- page 0 is the null page: never handed out; an empty slot writes there and nothing reads it
  unmasked.
- pages 1 .. Np*Tp: the prompt region, written once from the prefill with each prompt's real tokens
  moved to the front (key index == rotary position, no padding inside a sequence, as the kernel
  needs). Prompt i owns pages 1 + i*Tp .. ; its full pages are shared read-only by the G sequences
  of its group through their tables, so prompt memory does not grow with G. A sequence's first
  generated token lands in the prompt's last, partial page: the sequence first copies that page
  into a page of its own (`Allocation.copy_from`).
- the rest: the pool, a stack `free` [Z, Pg] of which the first `nfree` [Z] entries are free.
- `table` [Z, J, Tb]: slot j's page for key positions [c*Sg, (c+1)*Sg) in column c; columns past its
  length hold 0. Tb = ceil((P + M) / Sg).
A sequence with n prompt tokens and t fed tokens holds the private pages in columns
n//Sg .. (n+t-1)//Sg (none while t == 0); they go back to the pool when it finishes or is
preempted.

Shape letters: grpo_jax.shapes (Z row shards, J slots per shard, Np prompts per shard, Pg pages per
shard, Sg tokens per page, Tb table columns, Tp pages of one prompt).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


LAYOUTS = ("interleaved", "split", "heads")
LAYOUT_OF = {"pallas": "interleaved", "gather": "split", "gpu": "heads"}
"""The pages' layout each decode attention (`sampling.paged_attention`) reads."""


@flax.struct.dataclass
class PagedCache:
    kv: tuple[tuple[jax.Array, ...], ...]  # L x ((interleaved [Z, Pg, Sg, 2K, D],) or (keys, values))
    free: jax.Array  # int32 [Z, Pg]: the free stack (entries 0 .. nfree-1)
    nfree: jax.Array  # int32 [Z]
    table: jax.Array  # int32 [Z, J, Tb]: each slot's page per column (0 = none)
    prompt_len: jax.Array  # int32 [Z, Np]: real tokens of each prompt (n)
    slot_prompt: jax.Array  # int32 [Z, J]: the prompt each slot decodes from
    slot_t: jax.Array  # int32 [Z, J]: tokens fed to the slot's sequence so far (t)
    prompt_pages: int = flax.struct.field(pytree_node=False, default=1)  # Tp
    layout: str = flax.struct.field(pytree_node=False, default="split")  # one of LAYOUTS

    @property
    def page_size(self) -> int:
        return self.kv[0][-1].shape[-2]  # values: [.., Sg, D] in every layout

    @property
    def pages(self) -> int:
        return self.kv[0][0].shape[1]

    @property
    def pool(self) -> int:
        """Pages the allocator hands out per shard (all but the null page and the prompt region)."""
        return self.pages - 1 - self.prompt_len.shape[1] * self.prompt_pages

    @property
    def columns(self) -> int:
        return self.table.shape[2]

    def slot_len(self) -> jax.Array:
        """int32 [Z, J]: keys each slot's sequence has in the cache (n + t)."""
        return jax.vmap(lambda n, i: n[i])(self.prompt_len, self.slot_prompt) + self.slot_t

    def held_pages(self) -> jax.Array:
        """bool [Z, J, Tb]: the table entries that are the slot's own (private) pages."""
        return private_columns(self.slot_len() - self.slot_t, self.slot_t, self.page_size, self.columns)


def private_columns(n_ZJ, t_ZJ, page_size: int, columns: int) -> jax.Array:
    """bool [Z, J, Tb]: the table columns of a sequence's own pages, n prompt tokens and t fed
    tokens: n//Sg .. (n+t-1)//Sg, none while t == 0."""
    c = jnp.arange(columns)
    first, last = n_ZJ // page_size, (n_ZJ + t_ZJ - 1) // page_size
    return (c >= first[..., None]) & (c <= last[..., None]) & (t_ZJ[..., None] > 0)


def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, itemsize: int) -> int:
    """Bytes of one page id: Sg tokens' keys and values in every layer."""
    return num_layers * page_size * 2 * num_kv_heads * head_dim * itemsize


def pages_needed(prompt_slots: int, max_new_tokens: int, page_size: int) -> tuple[int, int]:
    """(Tp pages of a prompt region entry, the most private pages one sequence ever holds)."""
    Tp = -(-prompt_slots // page_size)
    return Tp, -(-max_new_tokens // page_size) + 1


def create_cache(keys_LNKPD: jax.Array, values_LNKPD: jax.Array, mask_NP: jax.Array, *, shards: int, slots: int,
                 pages: int, page_size: int, max_new_tokens: int, layout: str) -> PagedCache:
    """The page cache of N prefilled, left-padded prompts (keys/values [L, N, K, P, D], mask [N, P]):
    `pages` page ids per shard (null page, prompt region, pool) in `layout`, `slots` empty slots
    per shard."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown page layout {layout!r}: one of {LAYOUTS}")
    L, N, K, P, D = keys_LNKPD.shape
    Z, J, Sg = shards, slots, page_size
    Np = N // Z
    Tp, _ = pages_needed(P, max_new_tokens, Sg)
    pool = pages - 1 - Np * Tp
    n_N = mask_NP.astype(jnp.int32).sum(axis=1)
    # Real tokens to the front: key j of prompt i is prefill slot P - n_i + j (past n_i: masked filler).
    src_NP = jnp.minimum(P - n_N[:, None] + jnp.arange(P), P - 1)

    def region(x_NKPD):  # -> [Z, Np*Tp, Sg, K, D]: each prompt's keys (or values) in its pages
        x_NPKD = jnp.take_along_axis(x_NKPD.transpose(0, 2, 1, 3), src_NP[:, :, None, None], axis=1)
        x_NPKD = jnp.pad(x_NPKD, ((0, 0), (0, Tp * Sg - P), (0, 0), (0, 0)))
        return x_NPKD.reshape(Z, Np * Tp, Sg, K, D)

    def with_pool(x):  # the null page first, the pool's pages after the prompt region
        pad = [(0, 0)] * x.ndim
        pad[1] = (1, pool)
        return jnp.pad(x, pad)

    def layer(l):
        k, v = region(keys_LNKPD[l]), region(values_LNKPD[l])
        if layout == "interleaved":
            return (with_pool(jnp.stack([k, v], axis=4).reshape(Z, Np * Tp, Sg, 2 * K, D)),)
        if layout == "heads":
            return with_pool(k.transpose(0, 1, 3, 2, 4)), with_pool(v.transpose(0, 1, 3, 2, 4))
        return with_pool(k.transpose(0, 1, 3, 4, 2)), with_pool(v.transpose(0, 1, 3, 2, 4))

    first_pool = 1 + Np * Tp
    free = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32) + first_pool, (Z, pages))
    return PagedCache(kv=tuple(layer(l) for l in range(L)),
                      free=jnp.where(jnp.arange(pages) < pool, free, 0), nfree=jnp.full((Z,), pool, jnp.int32),
                      table=jnp.zeros((Z, J, -(-(P + max_new_tokens) // Sg)), jnp.int32),
                      prompt_len=n_N.reshape(Z, Np), slot_prompt=jnp.zeros((Z, J), jnp.int32),
                      slot_t=jnp.zeros((Z, J), jnp.int32), prompt_pages=Tp, layout=layout)


def write_token(pages: tuple[jax.Array, ...], page_ZJ, offset_ZJ, k_ZJKD, v_ZJKD, *,
                layout: str) -> tuple[jax.Array, ...]:
    """One layer's pages (in `layout`) with each slot's new key/value [Z, J, K, D] at (page, offset)."""
    def put(a, p, o, x):
        return a.at[p, o].set(x)

    def put_heads(a, p, o, x):  # a [Pg, K, Sg, D], x [J, K, D]
        return a.at[p, :, o].set(x)

    if layout == "interleaved":
        Z, J, K, D = k_ZJKD.shape
        new = jnp.stack([k_ZJKD, v_ZJKD], axis=3).reshape(Z, J, 2 * K, D).astype(pages[0].dtype)
        return (jax.vmap(put)(pages[0], page_ZJ, offset_ZJ, new),)
    keys, values = pages
    if layout == "heads":
        keys = jax.vmap(put_heads)(keys, page_ZJ, offset_ZJ, k_ZJKD.astype(keys.dtype))
    else:
        keys = jax.vmap(lambda a, p, o, x: a.at[p, :, :, o].set(x))(keys, page_ZJ, offset_ZJ,
                                                                   k_ZJKD.astype(keys.dtype))
    values = jax.vmap(put_heads)(values, page_ZJ, offset_ZJ, v_ZJKD.astype(values.dtype))
    return keys, values


def prompt_table(cache: PagedCache, prompt_ZJ: jax.Array) -> jax.Array:
    """int32 [Z, J, Tb]: a new sequence's table: its prompt's pages in the first ceil(n/Sg) columns."""
    n_ZJ = jax.vmap(lambda n, i: n[i])(cache.prompt_len, prompt_ZJ)
    c = jnp.arange(cache.columns)
    ids = 1 + prompt_ZJ[..., None] * cache.prompt_pages + c
    return jnp.where(c * cache.page_size < n_ZJ[..., None], ids, 0).astype(jnp.int32)


def push_pages(cache: PagedCache, give_ZJT: jax.Array, table_ZJT: jax.Array | None = None) -> PagedCache:
    """Return the entries marked in `give_ZJT` (bool [Z, J, Tb]) of the slots' table (or of
    `table_ZJT`, e.g. parked episodes' tables) to the free stack."""
    Z = give_ZJT.shape[0]
    give = give_ZJT.reshape(Z, -1)
    at = cache.nfree[:, None] + jnp.cumsum(give, axis=1, dtype=jnp.int32) - 1
    at = jnp.where(give, at, cache.pages)  # the others fall outside and are dropped
    table = cache.table if table_ZJT is None else table_ZJT
    free = jax.vmap(lambda f, i, p: f.at[i].set(p, mode="drop"))(cache.free, at, table.reshape(Z, -1))
    return cache.replace(free=free, nfree=cache.nfree + give.sum(axis=1, dtype=jnp.int32))


def pop_pages(cache: PagedCache, need_ZJ: jax.Array) -> tuple[jax.Array, PagedCache]:
    """A page from the free stack for every slot marked in `need_ZJ` (bool [Z, J]; the caller made
    sure there are enough) -> (int32 [Z, J] page ids, 0 where none was needed; the cache)."""
    rank = jnp.cumsum(need_ZJ, axis=1, dtype=jnp.int32) - 1
    at = jnp.clip(cache.nfree[:, None] - 1 - rank, 0, cache.pages - 1)
    page = jnp.where(need_ZJ, jax.vmap(lambda f, i: f[i])(cache.free, at), 0)
    return page, cache.replace(nfree=cache.nfree - need_ZJ.sum(axis=1, dtype=jnp.int32))


def copy_pages(cache: PagedCache, src_ZJ: jax.Array, dst_ZJ: jax.Array, copy_ZJ: jax.Array) -> PagedCache:
    """Copy page src -> dst in every layer for the slots marked in `copy_ZJ` (the prompt's partial
    last page into a new sequence's first page). A scatter in place, not a `lax.cond`: on XLA:CPU a
    conditional that returns the pages copied every layer's pages each step it ran."""
    dst_ZJ = jnp.where(copy_ZJ, dst_ZJ, cache.pages)  # dropped
    def copy(x):
        return jax.vmap(lambda a, s, d: a.at[d].set(a[s], mode="drop"))(x, src_ZJ, dst_ZJ)

    return cache.replace(kv=jax.tree.map(copy, cache.kv))
