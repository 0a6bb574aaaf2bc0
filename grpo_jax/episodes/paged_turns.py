"""Multi-turn episodes on the paged engine (`sampling.engine: paged`): the turns of
grpo_jax.episodes.turns (sampling, forcing the environment's tokens, paused while the host works)
in the paged engine's slots (grpo_jax.engine.paged), so an episode holds cache pages for the
tokens its trajectory has, not for the trajectory's capacity.

What differs from the continuous engine's episodes:
- **Parking costs no memory.** The host parks an episode whose environment is slow while others
  wait for a slot: its turn state (mode, the environment tokens still to feed, its model-token
  count, its trajectory position) is saved per episode (`Saved`) and its table row goes to the
  spot (`spot_table`, `spot_t`); its pages stay where they are, so loading it back is a table-row
  move, not a copy (the continuous engine keeps a second cache for its parking spots).
- **Running short.** When a step needs more pages than are free, the parked episodes' pages go
  back first (idle work, the fewest spots that cover the shortfall), then episodes in slots are
  preempted: those waiting on their environment (paused) first, then the youngest running ones,
  as the paged engine preempts sequences. A preempted episode saves its turn, gives its pages back
  and waits to be admitted again; one preempted while paused is admitted only once the host has
  answered it, by episode (`episode_view`, `host_update_paged`), so it does not come back only to
  wait (preempting the youngest running ones first while paused ones kept their pages made a short
  pool churn: the preempted episode came back as the youngest and was preempted again).
  The pool can take back every page not in the oldest running episode's table and holds at least
  one whole trajectory, so the oldest always has room.
- **Returning without pages replays.** A preempted episode, or a parked one whose pages were taken
  back, starts over from its prompt and feeds its recorded trajectory, model and environment tokens
  alike, one per step (`replay_to`: no draw, nothing recorded), then goes on in the mode it left
  in. Its tokens and log-probs are the ones recorded before it left, so a rollout does not depend
  on the pool, the slots, the parking or the preemptions.
- The host sees through the replay (`host_view`: the position it left at, the mode it will
  resume in), so grpo_jax.episodes.host drives both engines the same way.

Shape letters: grpo_jax.shapes (Z row shards, J slots per shard, Rb episodes per shard, U the
most environment tokens one answer may have, M the trajectory capacity, Tb table columns).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.config import SamplingConfig
from grpo_jax.engine.pages import private_columns, push_pages
from grpo_jax.engine.routing import record
from grpo_jax.engine.layouts import page_needs, take_pages
from grpo_jax.engine.paged import PagedState, admit, count_step, resume_paged, seat, start_paged
from grpo_jax.episodes.turns import FORCING, PAUSED, emit_tokens

TURN = ("mode", "forced_n", "forced_i", "model_tokens")  # a slot's turn state, saved per episode


@flax.struct.dataclass
class Saved:
    """Per episode, its turn state when it last left a slot (zeros: a new episode)."""

    t: jax.Array  # int32 [Z, Rb]: its trajectory's tokens (what it replays on return)
    mode: jax.Array  # int32 [Z, Rb]
    forced: jax.Array  # int32 [Z, Rb, U]
    forced_n: jax.Array  # int32 [Z, Rb]
    forced_i: jax.Array  # int32 [Z, Rb]
    model_tokens: jax.Array  # int32 [Z, Rb]


@flax.struct.dataclass
class PagedTurnState:
    """The loop state of episodes on pages: the paged engine's (its M the trajectory capacity),
    each slot's turn (as `turns.TurnState`), how far it replays, the saved turns and the spots."""

    engine: PagedState
    mode: jax.Array  # int32 [Z, J]: SAMPLING, FORCING or PAUSED (after the replay, if one runs)
    forced: jax.Array  # int32 [Z, J, U]
    forced_n: jax.Array  # int32 [Z, J]
    forced_i: jax.Array  # int32 [Z, J]
    model_tokens: jax.Array  # int32 [Z, J]
    release: jax.Array  # bool [Z, J]
    replay_to: jax.Array  # int32 [Z, J]: the slot feeds recorded tokens while slot_t < replay_to
    env: jax.Array  # bool [Z, Rb, M]
    saved: Saved
    spots: jax.Array  # int32 [Z, J]: the episode the host parked at each spot, -1 = free
    spot_table: jax.Array  # int32 [Z, J, Tb]: its table row when it left its slot
    spot_t: jax.Array  # int32 [Z, J]: the fed tokens its pages hold (0: none, taken back or never)

    def position(self) -> jax.Array:
        """int32 [Z, J]: each slot's trajectory tokens, replayed or not (the host's `t`)."""
        return jnp.maximum(self.engine.cache.slot_t, self.replay_to)

    def blocked(self) -> jax.Array:
        """bool [Z, Rb]: episodes out of their slot that wait on their environment (preempted while
        paused): not admitted until the host answers them (by episode, `host_update_paged`)."""
        return blocked(self.engine.pending, self.saved)

    def host_view(self) -> tuple:
        """As `turns.TurnState.host_view`: a replaying slot shows where it left and the mode it resumes in."""
        e = self.engine
        return e.seq, self.mode, self.position(), jnp.any(e.pending & ~self.blocked(), axis=1)

    def episode_view(self) -> tuple:
        """Per episode [Z, Rb], for the host to answer episodes preempted out of their slot: its
        mode, its trajectory position, and whether it is out of a slot after it started."""
        e = self.engine
        return self.saved.mode, self.saved.t, e.pending & e.started


def blocked(pending_ZR, saved: Saved) -> jax.Array:
    """`PagedTurnState.blocked` of these pending episodes and saved turns."""
    return pending_ZR & (saved.mode == PAUSED)


def start_paged_turns(model, ids_NP, mask_NP, rng, *, config: SamplingConfig, mesh: Mesh, capacity: int,
                      env_tokens: int) -> PagedTurnState:
    """Prefill the prompts into pages and admit the first episodes (`start_paged` with a trajectory
    of `capacity` tokens)."""
    loop, st = start_paged(model, ids_NP, mask_NP, rng, config=dataclasses.replace(config, max_new_tokens=capacity),
                           mesh=mesh, pool=True)
    Z, J = st.seq.shape
    Rb = st.tokens.shape[1]
    hold, zeros = loop.hold, functools.partial(jnp.zeros, dtype=jnp.int32)
    saved = Saved(t=hold(zeros((Z, Rb))), mode=hold(zeros((Z, Rb))), forced=hold(zeros((Z, Rb, env_tokens))),
                  forced_n=hold(zeros((Z, Rb))), forced_i=hold(zeros((Z, Rb))), model_tokens=hold(zeros((Z, Rb))))
    return PagedTurnState(engine=st, mode=hold(zeros((Z, J))), forced=hold(zeros((Z, J, env_tokens))),
                          forced_n=hold(zeros((Z, J))), forced_i=hold(zeros((Z, J))),
                          model_tokens=hold(zeros((Z, J))), release=hold(jnp.zeros((Z, J), jnp.bool_)),
                          replay_to=hold(zeros((Z, J))), env=hold(jnp.zeros(st.tokens.shape, jnp.bool_)),
                          saved=saved, spots=hold(jnp.full((Z, J), -1, jnp.int32)),
                          spot_table=hold(jnp.zeros_like(st.cache.table)), spot_t=hold(zeros((Z, J))))


def paged_turn_step(loop, budget: int, ts: PagedTurnState) -> PagedTurnState:
    """One step: replay, draw or force; record; end turns; free ended episodes' pages; take pages
    (when short: parked episodes' pages, then paused episodes', then the youngest running ones');
    feed; admit waiting episodes (not those waiting on their environment)."""
    hold, Rb = loop.hold, loop.lay.sequences
    seq_ZJ, t_ZJ = ts.engine.seq, ts.engine.cache.slot_t
    active_ZJ = seq_ZJ >= 0
    replaying_ZJ = active_ZJ & (t_ZJ < ts.replay_to)
    tok_ZJ, emitting_ZJ, ended_ZJ, ts = emit_tokens(loop, budget, ts, replaying_ZJ)
    st = ts.engine

    feeding_ZJ = (emitting_ZJ | replaying_ZJ) & ~ended_ZJ
    cache = push_pages(st.cache, st.cache.held_pages() & ended_ZJ[..., None])
    cache, lost_ZJ, ts = reclaim_parked(ts, cache, feeding_ZJ, loop.config.group_size)
    waiting_ZJ = active_ZJ & ~ended_ZJ & ~feeding_ZJ  # paused: idle until the host answers
    cache, write_ZJ, preempted_ZJ = take_pages(st.stamp, cache, active_ZJ & ~ended_ZJ, feeding_ZJ, waiting_ZJ)
    feeding_ZJ = feeding_ZJ & ~preempted_ZJ
    logits_ZJV, cache, experts_ZJLK = loop.pages.feed(tok_ZJ, cache, feeding_ZJ, write_ZJ)
    # Environment tokens and replayed ones too: a replay's routing is what the keys its episode's
    # later tokens attend came from (as the paged engine's recompute), so it replaces the first one.
    st = st.replace(experts=record(st.experts, experts_ZJLK, seq_ZJ, t_ZJ, feeding_ZJ))
    gone_ZJ = ended_ZJ | preempted_ZJ

    # A preempted episode leaves as if its token were fed: it replays it on return.
    position_ZJ = jnp.maximum(t_ZJ + emitting_ZJ, ts.replay_to)
    saved = save(ts, preempted_ZJ, position_ZJ)
    z_Z1 = jnp.arange(seq_ZJ.shape[0], dtype=jnp.int32)[:, None]
    counts = count_step(st.counts, loop.pages.held(cache), active_ZJ, emitting_ZJ, preempted_ZJ, position_ZJ)
    counts = {**counts, "preemptions": counts["preemptions"] + (lost_ZJ > 0).sum(dtype=jnp.int32),
              "recomputed_tokens": counts["recomputed_tokens"] + lost_ZJ.sum(dtype=jnp.int32)}
    st = st.replace(seq=hold(jnp.where(gone_ZJ, -1, seq_ZJ)), cache=jax.tree.map(hold, cache.replace(
                        slot_t=jnp.where(gone_ZJ, 0, cache.slot_t))),
                    pending=hold(st.pending.at[z_Z1, jnp.where(preempted_ZJ, seq_ZJ, Rb)].set(True, mode="drop")),
                    logits=hold(jnp.where(feeding_ZJ[..., None], logits_ZJV, st.logits)),
                    done=st.done + ended_ZJ.sum(axis=1, dtype=jnp.int32), counts=counts)
    before_ZJ = st.seq
    st = admit(loop, st, blocked_ZR=blocked(st.pending, saved))
    ts = ts.replace(engine=st, saved=saved, release=ts.release & ~ended_ZJ)
    ts = restore(ts, (before_ZJ < 0) & (st.seq >= 0))
    return ts.replace(env=hold(ts.env), saved=jax.tree.map(hold, ts.saved),
                      **{k: hold(getattr(ts, k)) for k in (*TURN, "forced", "release", "replay_to")})


def spot_pages(ts: PagedTurnState, cache, group_size: int) -> jax.Array:
    """bool [Z, J, Tb]: the entries of each spot's table that are its parked episode's own pages."""
    prompt_ZJ = jnp.maximum(ts.spots, 0) // group_size
    n_ZJ = jax.vmap(lambda n, i: n[i])(cache.prompt_len, prompt_ZJ)
    return private_columns(n_ZJ, jnp.where(ts.spots >= 0, ts.spot_t, 0), cache.page_size, cache.columns)


def reclaim_parked(ts: PagedTurnState, cache, feeding_ZJ, group_size: int) -> tuple:
    """When this step needs more pages than are free, the parked episodes' pages go back first, the
    fewest spots (in spot order) that cover the shortfall, or all of them -> (the cache, int32
    [Z, J] the tokens each spot's episode now replays on return (0: not taken), the turn state
    with those spots' pages gone)."""
    short_Z = page_needs(cache, feeding_ZJ).sum(axis=1, dtype=jnp.int32) - cache.nfree
    held_ZJT = spot_pages(ts, cache, group_size)
    gain_ZJ = held_ZJT.sum(axis=2, dtype=jnp.int32)
    take_ZJ = (gain_ZJ > 0) & (jnp.cumsum(gain_ZJ, axis=1) - gain_ZJ < short_Z[:, None])
    cache = push_pages(cache, held_ZJT & take_ZJ[..., None], ts.spot_table)
    return cache, jnp.where(take_ZJ, ts.spot_t, 0), ts.replace(spot_t=jnp.where(take_ZJ, 0, ts.spot_t))


def save(ts: PagedTurnState, leaving_ZJ, position_ZJ) -> Saved:
    """The saved turns with those of the `leaving_ZJ` slots' episodes written (`position_ZJ`: the
    trajectory tokens each one replays on return)."""
    st, sv = ts.engine, ts.saved
    z_Z1 = jnp.arange(st.seq.shape[0], dtype=jnp.int32)[:, None]
    at_ZJ = jnp.where(leaving_ZJ, st.seq, sv.t.shape[1])

    def put(dst, src):
        return dst.at[z_Z1, at_ZJ].set(src, mode="drop")

    return Saved(t=put(sv.t, position_ZJ), forced=put(sv.forced, ts.forced),
                 **{k: put(getattr(sv, k), getattr(ts, k)) for k in TURN})


def restore(ts: PagedTurnState, take_ZJ) -> PagedTurnState:
    """Slots `take_ZJ` (just seated with their episode, `paged.seat`) take its saved turn: they
    replay its trajectory, then go on in its mode."""
    st, sv = ts.engine, ts.saved
    row_ZJ = jnp.maximum(st.seq, 0)

    def get(slot, per_episode):
        got = jax.vmap(lambda a, i: a[i])(per_episode, row_ZJ)
        return jnp.where(take_ZJ.reshape(take_ZJ.shape + (1,) * (got.ndim - 2)), got, slot)

    return ts.replace(replay_to=get(ts.replay_to, sv.t), forced=get(ts.forced, sv.forced),
                      release=ts.release & ~take_ZJ, **{k: get(getattr(ts, k), getattr(sv, k)) for k in TURN})


def host_update_paged(ts: PagedTurnState, release_ZJ, forced_ZJU, forced_n_ZJ, rewind_ZJ, ep_forced_ZRU,
                      ep_n_ZR, ep_end_ZR, ep_rewind_ZR) -> PagedTurnState:
    """`turns.host_update` on pages: a rewind (a turn cut at the tool call's closing tag) also gives
    back the pages above the cut and ends a replay there. And the same by episode [Z, Rb], for
    episodes preempted out of their slot (`episode_view`): `ep_rewind` cuts one's turn (it then
    waits on its environment), `ep_n` > 0 gives one the first ep_n of `ep_forced` [Z, Rb, U] to
    feed once it is back in a slot (which unblocks its admission), `ep_end` ends one (counted done,
    never admitted again)."""
    st = ts.engine
    cache = st.cache
    position_ZJ = ts.position()
    rewound_ZJ = rewind_ZJ >= 0
    t_ZJ = jnp.where(rewound_ZJ, rewind_ZJ, position_ZJ)
    held_ZJT = cache.held_pages()
    cache = cache.replace(slot_t=jnp.minimum(cache.slot_t, t_ZJ))
    drop_ZJT = held_ZJT & ~cache.held_pages()
    cache = push_pages(cache, drop_ZJT)
    cache = cache.replace(table=jnp.where(drop_ZJT, 0, cache.table))
    inject_ZJ = forced_n_ZJ > 0
    z_Z1 = jnp.arange(t_ZJ.shape[0], dtype=jnp.int32)[:, None]
    at_ZJ = jnp.where(rewound_ZJ, st.seq, st.tokens.shape[1])
    st = st.replace(cache=cache, lengths=st.lengths.at[z_Z1, at_ZJ].set(t_ZJ, mode="drop"),
                    pending=st.pending & ~ep_end_ZR, done=st.done + ep_end_ZR.sum(axis=1, dtype=jnp.int32))
    sv, inject_ZR, cut_ZR = ts.saved, ep_n_ZR > 0, ep_rewind_ZR >= 0
    st = st.replace(lengths=jnp.where(cut_ZR, ep_rewind_ZR, st.lengths))
    sv = sv.replace(t=jnp.where(cut_ZR, ep_rewind_ZR, sv.t), mode=jnp.where(cut_ZR, PAUSED, sv.mode),
                    model_tokens=sv.model_tokens - jnp.where(cut_ZR, sv.t - ep_rewind_ZR, 0))
    saved = sv.replace(mode=jnp.where(inject_ZR, FORCING, sv.mode),
                       forced=jnp.where(inject_ZR[..., None], ep_forced_ZRU, sv.forced),
                       forced_n=jnp.where(inject_ZR, ep_n_ZR, sv.forced_n), forced_i=jnp.where(inject_ZR, 0, sv.forced_i))
    return ts.replace(engine=st, saved=saved, replay_to=jnp.minimum(ts.replay_to, t_ZJ),
                      mode=jnp.where(inject_ZJ, FORCING, jnp.where(rewound_ZJ, PAUSED, ts.mode)),
                      release=ts.release | release_ZJ, model_tokens=ts.model_tokens - (position_ZJ - t_ZJ),
                      forced=jnp.where(inject_ZJ[..., None], forced_ZJU, ts.forced),
                      forced_n=jnp.where(inject_ZJ, forced_n_ZJ, ts.forced_n),
                      forced_i=jnp.where(inject_ZJ, 0, ts.forced_i))


def move_paged(ts: PagedTurnState, park_to_ZJ, load_from_ZJ, ended_ZJ, *, group_size: int) -> PagedTurnState:
    """`turns.move_slots` on pages: a parked episode saves its turn and leaves its table row at its
    spot, its pages held; a loaded one takes the row back (and replays whatever its pages no longer
    hold: all of it if the pool took them back). A parked episode the host ended (`ended_ZJ`, by
    spot) gives its pages back. The host parks only paused episodes and feeds each loaded one the
    environment's tokens at once, so no loaded slot draws from stale logits."""
    st = ts.engine
    cache = st.cache
    Z, J = st.seq.shape
    z_Z1 = jnp.arange(Z, dtype=jnp.int32)[:, None]
    parking_ZJ, loading_ZJ = park_to_ZJ >= 0, load_from_ZJ >= 0
    cache = push_pages(cache, spot_pages(ts, cache, group_size) & ended_ZJ[..., None], ts.spot_table)
    spot_ZJ = jnp.where(parking_ZJ, park_to_ZJ, J)  # J: dropped

    def park(spots, x):
        return spots.at[z_Z1, spot_ZJ].set(x, mode="drop")

    ts = ts.replace(saved=save(ts, parking_ZJ, ts.position()), spots=park(jnp.where(ended_ZJ, -1, ts.spots), st.seq),
                    spot_table=park(ts.spot_table, cache.table), spot_t=park(jnp.where(ended_ZJ, 0, ts.spot_t), cache.slot_t))

    def back(spots):  # what the spot each loading slot loads from holds
        return jax.vmap(lambda a, i: a[i])(spots, jnp.maximum(load_from_ZJ, 0))

    row_ZJ, table_ZJT, t_ZJ = back(ts.spots), back(ts.spot_table), back(ts.spot_t)
    st = st.replace(seq=jnp.where(parking_ZJ, -1, st.seq), cache=cache.replace(
        slot_t=jnp.where(parking_ZJ, 0, cache.slot_t)), done=st.done + ended_ZJ.sum(axis=1, dtype=jnp.int32))
    st = seat(st, loading_ZJ, row_ZJ, group_size)
    kept_ZJ = loading_ZJ & (t_ZJ > 0)  # its pages are still its own
    c = st.cache
    st = st.replace(cache=c.replace(table=jnp.where(kept_ZJ[..., None], table_ZJT, c.table),
                                    slot_t=jnp.where(kept_ZJ, t_ZJ, c.slot_t)))
    freed_ZJ = jnp.zeros((Z, J), jnp.bool_).at[z_Z1, jnp.where(loading_ZJ, load_from_ZJ, J)].set(True, mode="drop")
    ts = ts.replace(engine=st, spots=jnp.where(freed_ZJ, -1, ts.spots), spot_t=jnp.where(freed_ZJ, 0, ts.spot_t))
    return restore(ts, loading_ZJ)


@functools.lru_cache(maxsize=16)
def paged_turn_programs(graphdef, config: SamplingConfig, mesh: Mesh, capacity: int, env_tokens: int):
    """`turns.turn_programs` for `sampling.engine: paged`: (start, advance, update, move), jitted."""
    budget = config.max_new_tokens
    big = dataclasses.replace(config, max_new_tokens=capacity)

    def start(state, ids, mask, rng):
        return start_paged_turns(nnx.merge(graphdef, state), ids, mask, rng, config=config, mesh=mesh,
                                 capacity=capacity, env_tokens=env_tokens)

    def advance(state, ts: PagedTurnState, steps):
        loop = resume_paged(nnx.merge(graphdef, state), big, mesh, ts.engine)
        Rb, end = loop.lay.sequences, ts.engine.counts["steps"] + steps

        def going(s: PagedTurnState):
            e = s.engine
            busy = (e.seq >= 0) & ((s.mode != PAUSED) | (e.cache.slot_t < s.replay_to))
            running = jnp.sum(e.seq >= 0, axis=1)
            admissible = jnp.any(e.seq < 0, axis=1) & jnp.any(e.pending & ~s.blocked(), axis=1) & (
                e.cache.nfree > running)
            progress = jnp.any(busy) | jnp.any(admissible) | jnp.any(s.release)
            return jnp.any(e.done < Rb) & (e.counts["steps"] < end) & progress
        return jax.lax.while_loop(going, functools.partial(paged_turn_step, loop, budget), ts)

    move = functools.partial(move_paged, group_size=config.group_size)
    return (jax.jit(start), jax.jit(advance, donate_argnums=1), jax.jit(host_update_paged, donate_argnums=0),
            jax.jit(move, donate_argnums=0))
