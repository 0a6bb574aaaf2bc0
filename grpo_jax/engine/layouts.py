"""Where the paged engine's sequences keep their keys and values: the two layouts of its cache,
behind one set of calls its loop makes (grpo_jax.engine.paged), so there is one loop.

- `PoolPages`: a pool of pages handed out as sequences grow (grpo_jax.engine.pages), read through
  each slot's page table (grpo_jax.engine.paged_decode: the gather path, or JAX's TPU kernel).
  When a step needs more pages than are free, the youngest sequences are preempted.
- `SlotPages`: one max-length reservation per slot (`sampling.kv_cache_bytes: 0`, the per-slot
  engine's settings): a slot's pages are contiguous, its own block of grpo_jax.engine.slots'
  `SlotCache` beside one copy of each prompt, so decode reads them in place, no page table and no
  gather (on this CPU the gather path ran the long-tailed workload at 0.50x the in-place read), and
  the pool is never short: nothing is preempted.

The calls (every `[Z, J]` array one per slot of each row shard):
`free(cache, finished)` gives the finished sequences' pages back; `take(stamp, cache, candidates,
going, idle)` -> (cache, the page each slot writes to, the preempted slots); `feed(tokens, cache,
going, write)` -> (logits [Z, J, V], the cache with slot_t + 1 where going, experts or None);
`room(cache, running_Z)` -> admissions the cache allows per shard; `compact(cache, take)` keeps the slots `take` picks (the drain);
`held(cache)` -> pages held per shard (0: reserved); `preempts`: whether a sequence can lose its pages.

Shape letters: grpo_jax.shapes (Z row shards, J slots per shard, Tb table columns).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from grpo_jax.engine.pages import PagedCache, copy_pages, pop_pages, prompt_table, push_pages
from grpo_jax.engine.slots import SlotCache


@dataclasses.dataclass(frozen=True)
class PoolPages:
    """The page pool: `decode` is `paged_decode_step` bound to the model; attention reads the first
    `phase_columns[phase]` table columns, the phase of the longest sequence going."""

    decode: Callable  # (tokens [Z, J], cache, write [Z, J], phase=) -> (logits, cache, experts)
    phase_columns: tuple[int, ...]
    preempts: ClassVar[bool] = True

    def free(self, cache: PagedCache, finished_ZJ) -> PagedCache:
        return push_pages(cache, cache.held_pages() & finished_ZJ[..., None])

    def take(self, stamp_ZJ, cache: PagedCache, candidates_ZJ, going_ZJ, idle_ZJ=None):
        return take_pages(stamp_ZJ, cache, candidates_ZJ, going_ZJ, idle_ZJ)

    def feed(self, tok_ZJ, cache: PagedCache, going_ZJ, write_ZJ) -> tuple:
        """The other slots feed at their prompt's end into the null page."""
        t_ZJ = cache.slot_t
        cache = cache.replace(slot_t=jnp.where(going_ZJ, t_ZJ, 0))
        widest = -(-(jnp.max(jnp.where(going_ZJ, cache.slot_len(), 0)) + 1) // cache.page_size)
        phase = jnp.sum(jnp.asarray(self.phase_columns) < widest, dtype=jnp.int32)
        logits_ZJV, cache, experts_ZJLK = self.decode(tok_ZJ, cache, write_ZJ,
                                                      phase=jnp.minimum(phase, len(self.phase_columns) - 1))
        return logits_ZJV, cache.replace(slot_t=jnp.where(going_ZJ, t_ZJ + 1, t_ZJ)), experts_ZJLK

    def room(self, cache: PagedCache, running_Z) -> jax.Array:
        """A page for each admission (its first page at the next step) and one for each running
        sequence (at most what it takes in the next page_size steps)."""
        return jnp.maximum(cache.nfree - running_Z, 0)

    def compact(self, cache: PagedCache, take: Callable) -> PagedCache:
        """Only the table rows and counters move; the pages stay where they are."""
        return cache.replace(table=take(cache.table), slot_prompt=take(cache.slot_prompt), slot_t=take(cache.slot_t))

    def held(self, cache: PagedCache) -> jax.Array:
        return cache.pool - cache.nfree


@dataclasses.dataclass(frozen=True)
class SlotPages:
    """One max-length reservation per slot, read in place: `decode` is `slot_decode_step` bound to
    the model; attention reads chunks 0..phase, the phase of the longest sequence going."""

    decode: Callable  # (tokens [Z, J], cache, phase=) -> (logits, cache, experts)
    preempts: ClassVar[bool] = False  # rows are admitted in order, once each

    def free(self, cache: SlotCache, finished_ZJ) -> SlotCache:
        return cache  # a refilled slot starts at 0: what the last sequence left is masked, then overwritten

    def take(self, stamp_ZJ, cache: SlotCache, candidates_ZJ, going_ZJ, idle_ZJ=None):
        return cache, None, jnp.zeros_like(going_ZJ)

    def feed(self, tok_ZJ, cache: SlotCache, going_ZJ, write_ZJ) -> tuple:
        """The other slots feed past their block's end: the write is dropped (a paused episode's
        block stays as it is)."""
        t_ZJ = cache.slot_t
        cache = cache.replace(slot_t=jnp.where(going_ZJ, t_ZJ, cache.capacity))
        phase = jnp.max(jnp.where(going_ZJ, t_ZJ, 0)) // cache.chunk_size
        logits_ZJV, cache, experts_ZJLK = self.decode(tok_ZJ, cache, phase=phase)
        return logits_ZJV, cache.replace(slot_t=jnp.where(going_ZJ, t_ZJ + 1, t_ZJ)), experts_ZJLK

    def room(self, cache: SlotCache, running_Z) -> jax.Array:
        return jnp.full_like(running_Z, cache.slot_t.shape[1])  # every free slot

    def compact(self, cache: SlotCache, take: Callable) -> SlotCache:
        """The slots' generated blocks move with them."""
        Z, J = cache.slot_t.shape

        def take_rows(x):  # [Z*J, ...] -> [Z*width, ...]
            y = take(x.reshape(Z, J, *x.shape[1:]))
            return y.reshape(-1, *x.shape[1:])

        return cache.replace(keys=jax.tree.map(take_rows, cache.keys), values=jax.tree.map(take_rows, cache.values),
                             slot_prompt=take(cache.slot_prompt), slot_t=take(cache.slot_t))

    def held(self, cache: SlotCache) -> jax.Array:
        return jnp.zeros(cache.slot_t.shape[:1], jnp.int32)


def seat_pages(cache: PagedCache | SlotCache, take_ZJ, prompt_ZJ) -> PagedCache | SlotCache:
    """Slots `take_ZJ` start a sequence of prompt `prompt_ZJ` (where taken) at its first token: a
    pool's table gets the prompt's pages; a reservation's block starts over."""
    if isinstance(cache, PagedCache):
        cache = cache.replace(table=jnp.where(take_ZJ[..., None], prompt_table(cache, prompt_ZJ), cache.table))
    return cache.replace(slot_prompt=prompt_ZJ, slot_t=jnp.where(take_ZJ, 0, cache.slot_t))


def take_pages(stamp_ZJ, cache: PagedCache, candidates_ZJ, going_ZJ,
               idle_ZJ=None) -> tuple[PagedCache, jax.Array, jax.Array]:
    """Pages for this step's writes: a page for every `going` slot whose next key starts a page (a
    new sequence's first page a copy of its prompt's partial last page), preempting the youngest
    of `candidates` (the slots whose pages may be taken back, `going` among them) when the pool is
    short (`idle_ZJ` among them first: episodes waiting on their environment) -> (the cache, int32
    [Z, J] the page each slot writes to (0, the null page, for the slots not going), bool [Z, J]
    the preempted slots, whose pages are back in the pool)."""
    Z, J = going_ZJ.shape
    t_ZJ, pos_ZJ = cache.slot_t, cache.slot_len()
    need_ZJ = page_needs(cache, going_ZJ)
    preempted_ZJ = youngest_to_preempt(stamp_ZJ, cache, candidates_ZJ, need_ZJ, idle_ZJ)
    cache = push_pages(cache, cache.held_pages() & preempted_ZJ[..., None])
    going_ZJ, need_ZJ = going_ZJ & ~preempted_ZJ, need_ZJ & ~preempted_ZJ
    page_ZJ, cache = pop_pages(cache, need_ZJ)
    col_ZJ = jnp.minimum(pos_ZJ // cache.page_size, cache.columns - 1)
    old_ZJ = jnp.take_along_axis(cache.table, col_ZJ[..., None], axis=2)[..., 0]
    cache = copy_pages(cache, old_ZJ, page_ZJ, need_ZJ & (t_ZJ == 0) & (pos_ZJ % cache.page_size != 0))
    z_Z1 = jnp.arange(Z, dtype=jnp.int32)[:, None]
    table = cache.table.at[z_Z1, jnp.arange(J)[None], jnp.where(need_ZJ, col_ZJ, cache.columns)].set(
        page_ZJ, mode="drop")
    return cache.replace(table=table), jnp.where(going_ZJ, jnp.where(need_ZJ, page_ZJ, old_ZJ), 0), preempted_ZJ


def page_needs(cache: PagedCache, going_ZJ) -> jax.Array:
    """bool [Z, J]: the `going` slots whose next key starts a page (a sequence's first fed token
    always: its first page is its own copy of the prompt's partial last page)."""
    return going_ZJ & ((cache.slot_len() % cache.page_size == 0) | (cache.slot_t == 0))


def youngest_to_preempt(stamp_ZJ, cache: PagedCache, going_ZJ, need_ZJ, idle_ZJ=None) -> jax.Array:
    """bool [Z, J]: the fewest youngest of the `going_ZJ` sequences (the `idle_ZJ` ones before
    the others) whose pages (and whose own need) cover the shard's shortfall of pages this step;
    none where the pool suffices."""
    held_ZJ = jnp.where(going_ZJ, cache.held_pages().sum(axis=2, dtype=jnp.int32), 0)
    short_Z = need_ZJ.sum(axis=1, dtype=jnp.int32) - cache.nfree
    key_ZJ = -stamp_ZJ if idle_ZJ is None else jnp.where(idle_ZJ, -stamp_ZJ - 2 ** 30, -stamp_ZJ)
    order_ZJ = jnp.argsort(jnp.where(going_ZJ, key_ZJ, jnp.iinfo(jnp.int32).max), axis=1, stable=True)
    gain_ZJ = jnp.take_along_axis(held_ZJ + need_ZJ.astype(jnp.int32), order_ZJ, axis=1)
    gain_ZJ = jnp.concatenate([jnp.zeros_like(gain_ZJ[:, :1]), jnp.cumsum(gain_ZJ, axis=1)], axis=1)
    k_Z = jnp.argmax(gain_ZJ >= short_Z[:, None], axis=1)  # 0 when nothing is short
    rank_ZJ = jnp.argsort(order_ZJ, axis=1)
    return going_ZJ & (rank_ZJ < k_Z[:, None])
