"""Where a parked episode's keys and values wait while its environment works (grpo_jax.episodes.turns'
`move_slots`), for each cache layout of the paged engine (grpo_jax.engine.layouts):
- a page pool: the episode's table row goes to its spot and its pages stay held, so loading it back
  is a table-row move; when a step needs more pages than are free, parked episodes' pages go back
  first (`reclaim_parked`), and such an episode replays its trajectory on return;
- one max-length reservation per slot: its block is copied to the spot's block and back, and nothing
  is ever taken back (that layout never runs short).

`spot_store(cache)` is the spots' storage at the start (int32 [Z, J, Tb] table rows, or the blocks
of a SlotCache); `park_store` writes the parking slots' rows or blocks into their spots, `load_store`
gives the loading slots theirs back.

Shape letters: grpo_jax.shapes (Z row shards, J slots (and spots) per shard, Tb table columns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.engine.layouts import page_needs
from grpo_jax.engine.pages import PagedCache, private_columns, push_pages
from grpo_jax.engine.slots import SlotCache


def spot_store(cache: PagedCache | SlotCache):
    """Empty spots: a table row each (a pool), or a block each (one reservation per slot)."""
    if isinstance(cache, SlotCache):
        return jax.tree.map(jnp.zeros_like, (cache.keys, cache.values))
    return jnp.zeros_like(cache.table)


def park_store(store, cache: PagedCache | SlotCache, spot_ZJ):
    """`store` with each slot's table row (or block) at its spot `spot_ZJ` (J: not parking)."""
    Z, J = spot_ZJ.shape
    z_Z1 = jnp.arange(Z, dtype=jnp.int32)[:, None]
    if isinstance(cache, SlotCache):
        def park(spots, block):  # [Z*J, ...] blocks, slot (z, j) at row z*J + j
            s, b = spots.reshape(Z, J, *spots.shape[1:]), block.reshape(Z, J, *block.shape[1:])
            return s.at[z_Z1, spot_ZJ].set(b, mode="drop").reshape(spots.shape)
        return jax.tree.map(park, store, (cache.keys, cache.values))
    return store.at[z_Z1, spot_ZJ].set(cache.table, mode="drop")


def load_store(cache: PagedCache | SlotCache, store, kept_ZJ, load_from_ZJ) -> PagedCache | SlotCache:
    """The `kept_ZJ` slots take back the table row (or block) of spot `load_from_ZJ`."""
    Z, J = kept_ZJ.shape
    at_ZJ = jnp.maximum(load_from_ZJ, 0)

    def back(spots_ZJ):
        return jax.vmap(lambda a, i: a[i])(spots_ZJ, at_ZJ)

    if isinstance(cache, SlotCache):
        def load(block, spots):
            b, s = block.reshape(Z, J, *block.shape[1:]), spots.reshape(Z, J, *spots.shape[1:])
            keep = kept_ZJ.reshape(Z, J, *(1,) * (b.ndim - 2))
            return jnp.where(keep, back(s), b).reshape(block.shape)
        keys, values = jax.tree.map(load, (cache.keys, cache.values), store)
        return cache.replace(keys=keys, values=values)
    return cache.replace(table=jnp.where(kept_ZJ[..., None], back(store), cache.table))


def spot_pages(spots_ZJ, spot_t_ZJ, cache: PagedCache, group_size: int) -> jax.Array:
    """bool [Z, J, Tb]: the entries of each spot's table that are its parked episode's own pages."""
    prompt_ZJ = jnp.maximum(spots_ZJ, 0) // group_size
    n_ZJ = jax.vmap(lambda n, i: n[i])(cache.prompt_len, prompt_ZJ)
    return private_columns(n_ZJ, jnp.where(spots_ZJ >= 0, spot_t_ZJ, 0), cache.page_size, cache.columns)


def free_ended(cache: PagedCache | SlotCache, store, spots_ZJ, spot_t_ZJ, ended_ZJ, group_size: int):
    """The cache with the pages of the parked episodes the host ended (by spot) back in the pool
    (a reservation per slot holds none)."""
    if isinstance(cache, SlotCache):
        return cache
    return push_pages(cache, spot_pages(spots_ZJ, spot_t_ZJ, cache, group_size) & ended_ZJ[..., None], store)


def reclaim_parked(cache: PagedCache, store, spots_ZJ, spot_t_ZJ, feeding_ZJ, group_size: int) -> tuple:
    """When this step needs more pages than are free, the parked episodes' pages go back first, the
    fewest spots (in spot order) that cover the shortfall, or all of them -> (the cache, int32
    [Z, J] the tokens each spot's episode now replays on return (0: not taken), the spots' fed
    tokens with those taken at 0)."""
    short_Z = page_needs(cache, feeding_ZJ).sum(axis=1, dtype=jnp.int32) - cache.nfree
    held_ZJT = spot_pages(spots_ZJ, spot_t_ZJ, cache, group_size)
    gain_ZJ = held_ZJT.sum(axis=2, dtype=jnp.int32)
    take_ZJ = (gain_ZJ > 0) & (jnp.cumsum(gain_ZJ, axis=1) - gain_ZJ < short_Z[:, None])
    cache = push_pages(cache, held_ZJT & take_ZJ[..., None], store)
    return cache, jnp.where(take_ZJ, spot_t_ZJ, 0), jnp.where(take_ZJ, 0, spot_t_ZJ)
