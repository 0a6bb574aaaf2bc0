"""Multi-turn episodes in the paged engine's slots (grpo_jax.engine.paged; `sampling.engine`
continuous or paged: continuous is the pool at one max-length trajectory per slot): a slot's
sequence is an episode's trajectory, model turns and environment tokens in one generated block, and
the host's environment answers are fed through the same decode steps as sampled tokens, so earlier
turns are never recomputed. Either cache layout of the engine (grpo_jax.engine.layouts): one
reservation of the whole trajectory per slot (`sampling.kv_cache_bytes: 0`, and `engine:
continuous`: read in place, never short), or a page pool, where an episode holds cache pages for
the tokens its trajectory has, not for the trajectory's capacity; what below says of pages,
preemption and replay is the pool's (grpo_jax.episodes.parking: where a parked episode waits).

Per slot, besides the engine's state, a mode:
- 0, sampling: the slot draws the model's next token (its own uniforms, as the engine's);
- 1, forcing: the slot feeds the next of the environment tokens the host gave it (`forced`), records
  it with log-prob 0 and marks it an environment position (`env`); after the last one the slot
  samples again, from the logits that last token produced;
- 2, paused: the model's turn ended (a stop token, or the episode's model-token budget); the turn's
  last token is fed like any other (the environment tokens that follow attend it), then the slot
  waits until the host answers (`host_update`).
The host also ends episodes (`release`), cuts a turn short at a tool call's closing tag (`rewind`:
the slot's position goes back to just after the tag; what the model drew beyond it is overwritten
by the environment's tokens), and parks an episode whose environment is slow while others wait
(`move_slots`). Trajectory capacity: the engine's max_new_tokens is the whole trajectory
(`capacity`, model and environment tokens); `budget`: model tokens per episode.

- **Parking costs no memory on a pool.** A parked episode's turn state (mode, the environment
  tokens still to feed, its model-token count, its trajectory position) is saved per episode
  (`Saved`) and its table row goes to the spot (`spot_store`, `spot_t`); its pages stay where they
  are, so loading it back is a table-row move, not a copy. (With a reservation per slot the spots
  hold a copy of the slots' blocks: twice the generated cache, as the per-slot engine's parking did.)
- **Running short.** When a step needs more pages than are free, the parked episodes' pages go
  back first (idle work, the fewest spots that cover the shortfall), then episodes in slots are
  preempted: those waiting on their environment (paused) first, then the youngest running ones,
  as the paged engine preempts sequences. A preempted episode saves its turn, gives its pages back
  and waits to be admitted again; one preempted while paused is admitted only once the host has
  answered it, by episode (`episode_view`, `host_update`), so it does not come back only to
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
  resume in).

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
from grpo_jax.engine.pages import push_pages
from grpo_jax.engine.routing import record
from grpo_jax.engine.slots import SlotCache
from grpo_jax.episodes.parking import free_ended, load_store, park_store, reclaim_parked, spot_store
from grpo_jax.engine.paged import PagedState, admit, count_step, resume_paged, seat, start_paged
from grpo_jax.engine.draw import draw_next

SAMPLING, FORCING, PAUSED = 0, 1, 2
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
class TurnState:
    """The loop state of episodes in the engine's slots: the paged engine's (its M the trajectory
    capacity), each slot's turn, how far it replays, the saved turns and the spots."""

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
    spot_store: object  # its table row when it left its slot [Z, J, Tb], or its block (episodes.parking)
    spot_t: jax.Array  # int32 [Z, J]: the fed tokens its pages hold (0: none, taken back or never)

    def position(self) -> jax.Array:
        """int32 [Z, J]: each slot's trajectory tokens, replayed or not (the host's `t`)."""
        return jnp.maximum(self.engine.cache.slot_t, self.replay_to)

    def blocked(self) -> jax.Array:
        """bool [Z, Rb]: episodes out of their slot that wait on their environment (preempted while
        paused): not admitted until the host answers them (by episode, `host_update`)."""
        return blocked(self.engine.pending, self.saved)

    def host_view(self) -> tuple:
        """What the host reads after a segment (grpo_jax.episodes.host): per slot its episode (-1:
        empty), mode and trajectory position (a replaying slot shows where it left and the mode it
        resumes in), and per shard whether episodes wait for a slot."""
        e = self.engine
        return e.seq, self.mode, self.position(), jnp.any(e.pending & ~self.blocked(), axis=1)

    def episode_view(self) -> tuple:
        """Per episode [Z, Rb], for the host to answer episodes preempted out of their slot: its
        mode, its trajectory position, and whether it is out of a slot after it started."""
        e = self.engine
        return self.saved.mode, self.saved.t, e.pending & e.started


def blocked(pending_ZR, saved: Saved) -> jax.Array:
    """`TurnState.blocked` of these pending episodes and saved turns."""
    return pending_ZR & (saved.mode == PAUSED)


def start_turns(model, ids_NP, mask_NP, rng, *, config: SamplingConfig, mesh: Mesh, capacity: int,
                      env_tokens: int) -> TurnState:
    """Prefill the prompts into pages and admit the first episodes (`start_paged` with a trajectory
    of `capacity` tokens)."""
    loop, st = start_paged(model, ids_NP, mask_NP, rng, config=dataclasses.replace(config, max_new_tokens=capacity),
                           mesh=mesh)
    Z, J = st.seq.shape
    Rb = st.tokens.shape[1]
    hold, zeros = loop.hold, functools.partial(jnp.zeros, dtype=jnp.int32)
    saved = Saved(t=hold(zeros((Z, Rb))), mode=hold(zeros((Z, Rb))), forced=hold(zeros((Z, Rb, env_tokens))),
                  forced_n=hold(zeros((Z, Rb))), forced_i=hold(zeros((Z, Rb))), model_tokens=hold(zeros((Z, Rb))))
    return TurnState(engine=st, mode=hold(zeros((Z, J))), forced=hold(zeros((Z, J, env_tokens))),
                          forced_n=hold(zeros((Z, J))), forced_i=hold(zeros((Z, J))),
                          model_tokens=hold(zeros((Z, J))), release=hold(jnp.zeros((Z, J), jnp.bool_)),
                          replay_to=hold(zeros((Z, J))), env=hold(jnp.zeros(st.tokens.shape, jnp.bool_)),
                          saved=saved, spots=hold(jnp.full((Z, J), -1, jnp.int32)),
                          spot_store=jax.tree.map(hold, spot_store(st.cache)), spot_t=hold(zeros((Z, J))))


def turn_step(loop, budget: int, ts: TurnState) -> TurnState:
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
    cache = loop.pages.free(st.cache, ended_ZJ)
    lost_ZJ = jnp.zeros_like(t_ZJ)
    if loop.pages.preempts:  # a pool: parked episodes' pages go back first when it runs short
        cache, lost_ZJ, spot_t = reclaim_parked(cache, ts.spot_store, ts.spots, ts.spot_t, feeding_ZJ,
                                                loop.config.group_size)
        ts = ts.replace(spot_t=spot_t)
    waiting_ZJ = active_ZJ & ~ended_ZJ & ~feeding_ZJ  # paused: idle until the host answers
    cache, write_ZJ, preempted_ZJ = loop.pages.take(st.stamp, cache, active_ZJ & ~ended_ZJ, feeding_ZJ, waiting_ZJ)
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


def emit_tokens(loop, budget: int, ts, replaying_ZJ=None) -> tuple:
    """Every occupied slot's token this step: drawn (sampling), the next forced one (forcing), or,
    for `replaying_ZJ` slots (the paged engine's recompute), the one its trajectory already holds.
    Records the drawn and forced ones (tokens, log-probs (0 when forced), env, lengths), counts the
    model's tokens and ends turns (a stop token or `budget` model tokens: paused) -> (tokens
    [Z, J], emitting [Z, J] (drawn or forced), ended [Z, J] (the trajectory's capacity, or the
    host released it), the state with outputs, env, mode, model_tokens and forced_i updated).
    `ts`: the TurnState."""
    config, hold, Rb = loop.config, loop.hold, loop.lay.sequences
    st = ts.engine
    seq_ZJ, mode_ZJ, t_ZJ = st.seq, ts.mode, st.cache.slot_t
    z_Z1 = jnp.arange(seq_ZJ.shape[0], dtype=jnp.int32)[:, None]
    active_ZJ = seq_ZJ >= 0
    free_ZJ = active_ZJ if replaying_ZJ is None else active_ZJ & ~replaying_ZJ
    sampling_ZJ, forcing_ZJ = free_ZJ & (mode_ZJ == SAMPLING), free_ZJ & (mode_ZJ == FORCING)
    drawn_ZJ, logp_ZJ = draw_next(loop, st)
    i_ZJ = jnp.minimum(ts.forced_i, ts.forced.shape[-1] - 1)
    tok_ZJ = jnp.where(forcing_ZJ, jnp.take_along_axis(ts.forced, i_ZJ[..., None], axis=2)[..., 0], drawn_ZJ)
    if replaying_ZJ is not None:
        at_ZJ = jnp.minimum(t_ZJ, st.tokens.shape[2] - 1)
        recorded_ZJ = jax.vmap(lambda a, s, t: a[s, t])(st.tokens, jnp.maximum(seq_ZJ, 0), at_ZJ)
        tok_ZJ = jnp.where(replaying_ZJ, recorded_ZJ, tok_ZJ)
    logp_ZJ = jnp.where(forcing_ZJ, 0.0, logp_ZJ)
    emitting_ZJ = sampling_ZJ | forcing_ZJ
    at_ZJ = jnp.where(emitting_ZJ, seq_ZJ, Rb)  # writes of paused, replaying and empty slots are dropped
    tokens = st.tokens.at[z_Z1, at_ZJ, t_ZJ].set(tok_ZJ, mode="drop")
    logprobs = st.logprobs.at[z_Z1, at_ZJ, t_ZJ].set(logp_ZJ, mode="drop")
    env = ts.env.at[z_Z1, at_ZJ, t_ZJ].set(forcing_ZJ, mode="drop")
    lengths = st.lengths.at[z_Z1, at_ZJ].set(t_ZJ + 1, mode="drop")

    model_tokens_ZJ = ts.model_tokens + sampling_ZJ
    stopped_ZJ = jnp.isin(tok_ZJ, jnp.asarray(config.stop_token_ids or (-1,), jnp.int32))
    turn_end_ZJ = sampling_ZJ & (stopped_ZJ | (model_tokens_ZJ >= budget))
    full_ZJ = emitting_ZJ & (t_ZJ + 1 >= config.max_new_tokens)  # the trajectory's capacity
    ended_ZJ = full_ZJ | (active_ZJ & ts.release)
    truncated = st.truncated.at[z_Z1, jnp.where(full_ZJ, seq_ZJ, Rb)].set(True, mode="drop")
    forced_i_ZJ = ts.forced_i + forcing_ZJ
    mode_ZJ = jnp.where(turn_end_ZJ, PAUSED, jnp.where(forcing_ZJ & (forced_i_ZJ >= ts.forced_n), SAMPLING, mode_ZJ))
    st = st.replace(tokens=hold(tokens), logprobs=hold(logprobs), lengths=hold(lengths), truncated=hold(truncated))
    return tok_ZJ, emitting_ZJ, ended_ZJ, ts.replace(engine=st, env=hold(env), mode=mode_ZJ,
                                                     model_tokens=model_tokens_ZJ, forced_i=forced_i_ZJ)


def save(ts: TurnState, leaving_ZJ, position_ZJ) -> Saved:
    """The saved turns with those of the `leaving_ZJ` slots' episodes written (`position_ZJ`: the
    trajectory tokens each one replays on return)."""
    st, sv = ts.engine, ts.saved
    z_Z1 = jnp.arange(st.seq.shape[0], dtype=jnp.int32)[:, None]
    at_ZJ = jnp.where(leaving_ZJ, st.seq, sv.t.shape[1])

    def put(dst, src):
        return dst.at[z_Z1, at_ZJ].set(src, mode="drop")

    return Saved(t=put(sv.t, position_ZJ), forced=put(sv.forced, ts.forced),
                 **{k: put(getattr(sv, k), getattr(ts, k)) for k in TURN})


def restore(ts: TurnState, take_ZJ) -> TurnState:
    """Slots `take_ZJ` (just seated with their episode, `paged.seat`) take its saved turn: they
    replay its trajectory, then go on in its mode."""
    st, sv = ts.engine, ts.saved
    row_ZJ = jnp.maximum(st.seq, 0)

    def get(slot, per_episode):
        got = jax.vmap(lambda a, i: a[i])(per_episode, row_ZJ)
        return jnp.where(take_ZJ.reshape(take_ZJ.shape + (1,) * (got.ndim - 2)), got, slot)

    return ts.replace(replay_to=get(ts.replay_to, sv.t), forced=get(ts.forced, sv.forced),
                      release=ts.release & ~take_ZJ, **{k: get(getattr(ts, k), getattr(sv, k)) for k in TURN})


def host_update(ts: TurnState, release_ZJ, forced_ZJU, forced_n_ZJ, rewind_ZJ, ep_forced_ZRU,
                      ep_n_ZR, ep_end_ZR, ep_rewind_ZR) -> TurnState:
    """The host's answers, by slot: `release` ends an episode, `forced` [Z, J, U] (its first
    `forced_n`) are the environment's tokens to feed, `rewind` cuts a turn at the tool call's
    closing tag (on a pool it also gives back the pages above the cut and ends a replay there).
    And the same by episode [Z, Rb], for
    episodes preempted out of their slot (`episode_view`): `ep_rewind` cuts one's turn (it then
    waits on its environment), `ep_n` > 0 gives one the first ep_n of `ep_forced` [Z, Rb, U] to
    feed once it is back in a slot (which unblocks its admission), `ep_end` ends one (counted done,
    never admitted again)."""
    st = ts.engine
    cache = st.cache
    position_ZJ = ts.position()
    rewound_ZJ = rewind_ZJ >= 0
    t_ZJ = jnp.where(rewound_ZJ, rewind_ZJ, position_ZJ)
    if isinstance(cache, SlotCache):
        cache = cache.replace(slot_t=jnp.minimum(cache.slot_t, t_ZJ))
    else:
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


def move_slots(ts: TurnState, park_to_ZJ, load_from_ZJ, ended_ZJ, *, group_size: int) -> TurnState:
    """Park and load, between segments: slot j with `park_to[j]` = p >= 0 moves its episode to spot
    p (it saves its turn; its table row, its pages held, or its block goes to the spot:
    grpo_jax.episodes.parking) and is left free for the next waiting episode; a free slot with
    `load_from[j]` = p >= 0 takes the episode parked at p back (and replays whatever its pages no
    longer hold: all of it if the pool took them back). A parked episode the host ended
    (`ended_ZJ`, by spot) gives its pages back. The host parks only paused episodes and feeds each loaded one the
    environment's tokens at once, so no loaded slot draws from stale logits."""
    st = ts.engine
    cache = st.cache
    Z, J = st.seq.shape
    z_Z1 = jnp.arange(Z, dtype=jnp.int32)[:, None]
    parking_ZJ, loading_ZJ = park_to_ZJ >= 0, load_from_ZJ >= 0
    cache = free_ended(cache, ts.spot_store, ts.spots, ts.spot_t, ended_ZJ, group_size)
    spot_ZJ = jnp.where(parking_ZJ, park_to_ZJ, J)  # J: dropped

    def park(spots, x):
        return spots.at[z_Z1, spot_ZJ].set(x, mode="drop")

    ts = ts.replace(saved=save(ts, parking_ZJ, ts.position()), spots=park(jnp.where(ended_ZJ, -1, ts.spots), st.seq),
                    spot_store=park_store(ts.spot_store, cache, spot_ZJ),
                    spot_t=park(jnp.where(ended_ZJ, 0, ts.spot_t), cache.slot_t))

    def back(spots):  # what the spot each loading slot loads from holds
        return jax.vmap(lambda a, i: a[i])(spots, jnp.maximum(load_from_ZJ, 0))

    row_ZJ, t_ZJ = back(ts.spots), back(ts.spot_t)
    st = st.replace(seq=jnp.where(parking_ZJ, -1, st.seq), cache=cache.replace(
        slot_t=jnp.where(parking_ZJ, 0, cache.slot_t)), done=st.done + ended_ZJ.sum(axis=1, dtype=jnp.int32))
    st = seat(st, loading_ZJ, row_ZJ, group_size)
    kept_ZJ = loading_ZJ & (t_ZJ > 0)  # its pages are still its own
    c = load_store(st.cache, ts.spot_store, kept_ZJ, load_from_ZJ)
    st = st.replace(cache=c.replace(slot_t=jnp.where(kept_ZJ, t_ZJ, c.slot_t)))
    freed_ZJ = jnp.zeros((Z, J), jnp.bool_).at[z_Z1, jnp.where(loading_ZJ, load_from_ZJ, J)].set(True, mode="drop")
    ts = ts.replace(engine=st, spots=jnp.where(freed_ZJ, -1, ts.spots), spot_t=jnp.where(freed_ZJ, 0, ts.spot_t))
    return restore(ts, loading_ZJ)


@functools.lru_cache(maxsize=16)
def turn_programs(graphdef, config: SamplingConfig, mesh: Mesh, capacity: int, env_tokens: int):
    """(start, advance, update, move), jitted: start(state, ids, mask, key) -> TurnState;
    advance(state, TurnState, steps) -> after up to `steps` steps (fewer once every episode is done
    or every occupied slot waits for the host); update(TurnState, release, forced, forced_n,
    rewind, and by episode: forced, forced_n, end, rewind) (`host_update`); move(TurnState,
    park_to, load_from, ended) (`move_slots`)."""
    budget = config.max_new_tokens
    big = dataclasses.replace(config, max_new_tokens=capacity)

    def start(state, ids, mask, rng):
        return start_turns(nnx.merge(graphdef, state), ids, mask, rng, config=config, mesh=mesh,
                                 capacity=capacity, env_tokens=env_tokens)

    def advance(state, ts: TurnState, steps):
        loop = resume_paged(nnx.merge(graphdef, state), big, mesh, ts.engine)
        Rb, end = loop.lay.sequences, ts.engine.counts["steps"] + steps

        def going(s: TurnState):
            e = s.engine
            busy = (e.seq >= 0) & ((s.mode != PAUSED) | (e.cache.slot_t < s.replay_to))
            running = jnp.sum(e.seq >= 0, axis=1)
            admissible = jnp.any(e.seq < 0, axis=1) & jnp.any(e.pending & ~s.blocked(), axis=1) & (
                loop.pages.room(e.cache, running) > 0)
            progress = jnp.any(busy) | jnp.any(admissible) | jnp.any(s.release)
            return jnp.any(e.done < Rb) & (e.counts["steps"] < end) & progress
        return jax.lax.while_loop(going, functools.partial(turn_step, loop, budget), ts)

    move = functools.partial(move_slots, group_size=config.group_size)
    return (jax.jit(start), jax.jit(advance, donate_argnums=1), jax.jit(host_update, donate_argnums=0),
            jax.jit(move, donate_argnums=0))
