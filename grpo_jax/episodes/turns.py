"""Multi-turn episodes in the continuous engine's slots (issue 28): a slot's sequence is an
episode's trajectory, model turns and environment tokens in one generated block, and the host's
environment answers are fed through the same decode steps as sampled tokens, so earlier turns are
never recomputed.

Per slot, besides the engine's state (grpo_jax.engine.continuous), a mode:
- 0, sampling: the slot draws the model's next token (its own uniforms, as the engine's);
- 1, forcing: the slot feeds the next of the environment tokens the host gave it (`forced`), records
  it with log-prob 0 and marks it an environment position (`env`); after the last one the slot
  samples again, from the logits that last token produced;
- 2, paused: the model's turn ended (a stop token, or the episode's model-token budget); the turn's
  last token is fed like any other (the environment tokens that follow attend it), then the slot
  waits, its generated block untouched, until the host answers (`host_update`).
The host also ends episodes (`release`: the environment said done, failed, or a limit was hit; the
slot is refilled with the next waiting episode), moves an episode whose environment is slow out of
its slot while others wait (`move_slots`: its block of the cache goes to a parking spot and the
slot takes the next waiting episode; the environment's answer later loads it back into a free
slot, its cache as it was, so nothing is recomputed), and cuts a turn short at a tool call's closing tag
(`rewind`: the slot's position goes back to just after the tag; what the model drew beyond it is
overwritten by the environment's tokens). Trajectory capacity: the engine's max_new_tokens is the
whole trajectory (`capacity`, model and environment tokens); `budget`: model tokens per episode.

Shape letters: grpo_jax.shapes (Z row shards, J slots per shard, Rb episodes per shard, U the
most environment tokens one answer may have, M the trajectory capacity: the engine's max_new_tokens).
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
from grpo_jax.engine.continuous import draw_next, refill, start_engine
from grpo_jax.engine.routing import record
from grpo_jax.engine.state import EngineState, resume_loop

SAMPLING, FORCING, PAUSED = 0, 1, 2


@flax.struct.dataclass
class Parking:
    """One parking spot per slot: a parked episode's block of the cache and what its slot knew of it."""

    keys: tuple[tuple[jax.Array, ...], ...]  # phases x L x [Z*J, K, D, C]: the spots' generated keys (SlotCache.keys)
    values: tuple[tuple[jax.Array, ...], ...]  # phases x L x [Z*J, K, C, D]: their values (SlotCache.values)
    seq: jax.Array  # int32 [Z, J]: the shard-local episode parked at each spot, -1 = free
    t: jax.Array  # int32 [Z, J]: its fed tokens when it left its slot (slot_t)
    prompt: jax.Array  # int32 [Z, J]: its prompt (slot_prompt)
    model_tokens: jax.Array  # int32 [Z, J]: its model tokens so far


@flax.struct.dataclass
class TurnState:
    """The loop state of episodes in the engine's slots: the engine's (`EngineState`, its M the
    trajectory capacity) and, per slot, its turn. Every array is split over the mesh's row shards."""

    engine: EngineState
    mode: jax.Array  # int32 [Z, J]: SAMPLING, FORCING or PAUSED
    forced: jax.Array  # int32 [Z, J, U]: the environment tokens the host gave the slot to feed
    forced_n: jax.Array  # int32 [Z, J]: how many of them there are
    forced_i: jax.Array  # int32 [Z, J]: how many of them were fed
    model_tokens: jax.Array  # int32 [Z, J]: model tokens of the slot's episode so far (its budget's count)
    release: jax.Array  # bool [Z, J]: the host ended the slot's episode; the slot is freed at the next step
    env: jax.Array  # bool [Z, Rb, M]: the position holds an environment token (log-prob 0, no loss)
    park: Parking

    def host_view(self) -> tuple:
        """What the host reads after a segment (grpo_jax.episodes.host): per slot its episode (-1:
        empty), mode and trajectory position, and per shard whether episodes wait for a slot."""
        e = self.engine
        return e.seq, self.mode, e.cache.slot_t, e.admitted < e.tokens.shape[1]


def start_turns(model, ids_NP, mask_NP, rng, *, config: SamplingConfig, mesh: Mesh, capacity: int,
                env_tokens: int) -> tuple:
    """Prefill the prompts and fill the slots (`start_engine` with a trajectory of `capacity`
    tokens) -> (the loop's constants, the TurnState)."""
    loop, st = start_engine(model, ids_NP, mask_NP, rng, config=dataclasses.replace(config, max_new_tokens=capacity),
                            mesh=mesh)
    Z, J = st.seq.shape
    hold, zeros = loop.hold, functools.partial(jnp.zeros, dtype=jnp.int32)
    park = Parking(keys=jax.tree.map(jnp.zeros_like, st.cache.keys), values=jax.tree.map(jnp.zeros_like, st.cache.values),
                   seq=hold(jnp.full((Z, J), -1, jnp.int32)), t=hold(zeros((Z, J))), prompt=hold(zeros((Z, J))),
                   model_tokens=hold(zeros((Z, J))))
    return loop, TurnState(engine=st, mode=hold(zeros((Z, J))), forced=hold(zeros((Z, J, env_tokens))),
                           forced_n=hold(zeros((Z, J))), forced_i=hold(zeros((Z, J))),
                           model_tokens=hold(zeros((Z, J))), release=hold(jnp.zeros((Z, J), jnp.bool_)),
                           env=hold(jnp.zeros(st.tokens.shape, jnp.bool_)), park=park)


def turn_step(loop, budget: int, ts: TurnState) -> TurnState:
    """One engine step of episodes: draw or force, record, end turns, feed, refill freed slots."""
    hold = loop.hold
    seq_ZJ, t_ZJ = ts.engine.seq, ts.engine.cache.slot_t
    active_ZJ = seq_ZJ >= 0
    tok_ZJ, emitting_ZJ, ended_ZJ, ts = emit_tokens(loop, budget, ts)
    st = ts.engine

    # Feed every emitted token (a turn's last one too); other slots write past their block (dropped).
    feeding_ZJ = emitting_ZJ & ~ended_ZJ
    cache = st.cache
    capacity = cache.capacity
    cache = cache.replace(slot_t=jnp.where(feeding_ZJ, t_ZJ, capacity))
    phase = jnp.max(jnp.where(feeding_ZJ, t_ZJ, 0)) // loop.phase_size
    logits_ZJV, cache, experts_ZJLK = loop.decode(tok_ZJ, cache, phase=phase)
    cache = cache.replace(slot_t=jnp.where(feeding_ZJ, t_ZJ + 1, t_ZJ))
    logits_ZJV = jnp.where(feeding_ZJ[..., None], logits_ZJV, st.logits)
    # The environment's tokens are fed here too: their experts are recorded as the model's are.
    st = st.replace(experts=record(st.experts, experts_ZJLK, seq_ZJ, t_ZJ, feeding_ZJ))

    st, fill_ZJ = refill(loop, st, seq_ZJ, cache, logits_ZJV, ended_ZJ)
    reset_ZJ = fill_ZJ | ended_ZJ
    st = st.replace(steps=st.steps + 1, useful=st.useful + emitting_ZJ.sum(dtype=jnp.int32),
                    slot_steps=st.slot_steps + active_ZJ.size)
    return ts.replace(engine=st, mode=hold(jnp.where(reset_ZJ, SAMPLING, ts.mode)),
                      model_tokens=hold(jnp.where(reset_ZJ, 0, ts.model_tokens)),
                      forced_n=hold(jnp.where(reset_ZJ, 0, ts.forced_n)),
                      forced_i=hold(jnp.where(reset_ZJ, 0, ts.forced_i)), release=hold(ts.release & ~ended_ZJ))


def emit_tokens(loop, budget: int, ts, replaying_ZJ=None) -> tuple:
    """Every occupied slot's token this step: drawn (sampling), the next forced one (forcing), or,
    for `replaying_ZJ` slots (the paged engine's recompute), the one its trajectory already holds.
    Records the drawn and forced ones (tokens, log-probs (0 when forced), env, lengths), counts the
    model's tokens and ends turns (a stop token or `budget` model tokens: paused) -> (tokens
    [Z, J], emitting [Z, J] (drawn or forced), ended [Z, J] (the trajectory's capacity, or the
    host released it), the state with outputs, env, mode, model_tokens and forced_i updated).
    `ts`: this module's TurnState or the paged engine's (grpo_jax.episodes.paged_turns)."""
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


def host_update(ts: TurnState, release_ZJ, forced_ZJU, forced_n_ZJ, rewind_ZJ) -> TurnState:
    """The host's answers, applied between segments: `release` (bool) ends those slots' episodes at
    the next step; `rewind` (int, -1 = no) moves a sampling slot's position back to that many fed
    tokens and pauses it (a turn cut at a tool call's closing tag; the tokens drawn past it are
    overwritten later and `lengths` follows); `forced_n` > 0 gives a paused slot the first
    forced_n of `forced` [Z, J, U] to feed."""
    st = ts.engine
    cache = st.cache
    rewound_ZJ = rewind_ZJ >= 0
    t_ZJ = jnp.where(rewound_ZJ, rewind_ZJ, cache.slot_t)
    model_tokens_ZJ = ts.model_tokens - (cache.slot_t - t_ZJ)  # what was drawn past the cut
    inject_ZJ = forced_n_ZJ > 0
    mode_ZJ = jnp.where(inject_ZJ, FORCING, jnp.where(rewound_ZJ, PAUSED, ts.mode))
    z_Z1 = jnp.arange(t_ZJ.shape[0], dtype=jnp.int32)[:, None]
    at_ZJ = jnp.where(rewound_ZJ, st.seq, st.tokens.shape[1])
    st = st.replace(cache=cache.replace(slot_t=t_ZJ), lengths=st.lengths.at[z_Z1, at_ZJ].set(t_ZJ, mode="drop"))
    return ts.replace(engine=st, mode=mode_ZJ, release=ts.release | release_ZJ, model_tokens=model_tokens_ZJ,
                      forced=jnp.where(inject_ZJ[..., None], forced_ZJU, ts.forced),
                      forced_n=jnp.where(inject_ZJ, forced_n_ZJ, ts.forced_n),
                      forced_i=jnp.where(inject_ZJ, 0, ts.forced_i))


def move_slots(ts: TurnState, park_to_ZJ, load_from_ZJ, ended_ZJ) -> TurnState:
    """Park and load, between segments: slot j with `park_to[j]` = p >= 0 moves its episode to
    parking spot p (its cache block, position, prompt and model-token count) and is left free for
    the next waiting episode; a free slot with `load_from[j]` = p >= 0 takes the episode parked at
    p, exactly as it left (the host then gives it the environment's tokens, `host_update`).
    `ended_ZJ` (bool, by spot): parked episodes the host ended without loading them (counted
    done). A spot is never parked into and loaded from in one call."""
    st, park = ts.engine, ts.park
    cache = st.cache
    Z, J = st.seq.shape
    z_Z1, j_1J = jnp.arange(Z, dtype=jnp.int32)[:, None], jnp.arange(J, dtype=jnp.int32)[None]
    parking_ZJ, loading_ZJ = park_to_ZJ >= 0, load_from_ZJ >= 0
    to_X = jnp.where(parking_ZJ, z_Z1 * J + park_to_ZJ, Z * J).reshape(-1)  # out of range: dropped
    from_X = (z_Z1 * J + jnp.maximum(load_from_ZJ, 0)).reshape(-1)
    into_X = jnp.where(loading_ZJ, z_Z1 * J + j_1J, Z * J).reshape(-1)

    def park_block(spots, block):
        return spots.at[to_X].set(block, mode="drop")

    spot_ZJ = jnp.where(parking_ZJ, park_to_ZJ, J)

    def park_row(spots_ZJ, x_ZJ):
        return spots_ZJ.at[z_Z1, spot_ZJ].set(x_ZJ, mode="drop")

    parked = Parking(keys=jax.tree.map(park_block, park.keys, cache.keys),
                     values=jax.tree.map(park_block, park.values, cache.values), seq=park_row(park.seq, st.seq),
                     t=park_row(park.t, cache.slot_t), prompt=park_row(park.prompt, cache.slot_prompt),
                     model_tokens=park_row(park.model_tokens, ts.model_tokens))

    def load_block(block, spots):
        return block.at[into_X].set(spots[from_X], mode="drop")

    def back(spots_ZJ):  # what the spot each loading slot loads from holds
        return jnp.take_along_axis(spots_ZJ, jnp.maximum(load_from_ZJ, 0), axis=1)

    freed_ZJ = jnp.zeros((Z, J), jnp.bool_).at[z_Z1, jnp.where(loading_ZJ, load_from_ZJ, J)].set(True, mode="drop")
    cache = cache.replace(keys=jax.tree.map(load_block, cache.keys, parked.keys),
                          values=jax.tree.map(load_block, cache.values, parked.values),
                          slot_t=jnp.where(loading_ZJ, back(parked.t), cache.slot_t),
                          slot_prompt=jnp.where(loading_ZJ, back(parked.prompt), cache.slot_prompt))
    seq_ZJ = jnp.where(loading_ZJ, back(parked.seq), jnp.where(parking_ZJ, -1, st.seq))
    st = st.replace(cache=cache, seq=seq_ZJ, done=st.done + ended_ZJ.sum(axis=1, dtype=jnp.int32))
    return ts.replace(engine=st, park=parked.replace(seq=jnp.where(freed_ZJ, -1, parked.seq)),
                      model_tokens=jnp.where(loading_ZJ, back(parked.model_tokens), ts.model_tokens),
                      mode=jnp.where(loading_ZJ | parking_ZJ, PAUSED, ts.mode))


@functools.lru_cache(maxsize=16)
def turn_programs(graphdef, config: SamplingConfig, mesh: Mesh, capacity: int, env_tokens: int):
    """(start, advance, update, move), jitted: start(state, ids, mask, key) -> TurnState;
    advance(state, TurnState, steps) -> after up to `steps` steps (fewer once every episode is done
    or every occupied slot waits for the host); update(TurnState, release, forced, forced_n,
    rewind); move(TurnState, park_to, load_from, ended) (`move_slots`)."""
    budget = config.max_new_tokens
    big = dataclasses.replace(config, max_new_tokens=capacity)

    def start(state, ids, mask, rng):
        return start_turns(nnx.merge(graphdef, state), ids, mask, rng, config=config, mesh=mesh, capacity=capacity,
                           env_tokens=env_tokens)[1]

    def advance(state, ts: TurnState, steps):
        loop = resume_loop(nnx.merge(graphdef, state), big, mesh, ts.engine)
        Rb, end = loop.lay.sequences, ts.engine.steps + steps

        def going(s: TurnState):
            e = s.engine
            busy = (e.seq >= 0) & (s.mode != PAUSED)
            waiting = jnp.any((e.seq < 0)) & jnp.any(e.admitted < Rb)
            progress = jnp.any(busy) | waiting | jnp.any(s.release)
            return jnp.any(e.done < Rb) & (e.steps < end) & progress
        return jax.lax.while_loop(going, functools.partial(turn_step, loop, budget), ts)

    return (jax.jit(start), jax.jit(advance, donate_argnums=1), jax.jit(host_update, donate_argnums=0),
            jax.jit(move_slots, donate_argnums=0))
