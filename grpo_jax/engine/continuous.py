"""The continuous engine (`sampling.engine: continuous`): a fixed number of decode slots, each
refilled with the next waiting sequence as soon as its sequence stops, so no slot-step is spent on
a finished row while sequences are waiting.

One jitted program per call: the N prompts are prefilled once each (their keys and values stay one
copy per prompt, `engine.slots.SlotCache`), then one `lax.while_loop` over the typed loop state
(`engine.state.EngineState`) whose step
1. draws the next token of every occupied slot (from its own key, below),
2. records it in the sequence's row of the outputs and marks the sequences that stopped (a stop
   token, or max_new_tokens reached),
3. feeds every continuing slot's token through one decode step (`slot_decode_step`, in the
   attention phase of the longest sequence in flight),
4. refills every free slot with the next waiting sequence of its shard: its prompt's prefill
   logits draw its first token at the next step, its generated block starts empty.
The loop, the refills and the bookkeeping all stay on device: no host round trip per refill.
The drain: once every queue is empty and no shard has more than half its slots busy, `compact`
moves the sequences in flight into half the slots and the loop goes on there (`drain_widths`: once,
from 8 slots up), so the last long sequences do not carry the idle slots with them.
With a slot for every sequence nothing can be refilled: the call runs the lock-step loop
(grpo_jax.engine.lockstep), which reads each prompt once per group, with the same draws.

Sequences: R = N x G, row r = i*G + j (sample j of prompt i), as the static engine's. They are
admitted in row order; with a mesh the rows (prompts and slots) are split into Z = data x fsdp x expert
shards, each with its own queue of its own prompts' sequences and its own `slots / Z` slots, so a
slot only ever reads prompts on its own devices.

Exact and reproducible. Sequence r draws token t with the t-th of its own uniforms,
uniform(fold_in(rng, r), (M,)) (`sequence_uniforms`, drawn once per call), whatever slot it runs
in and whenever, so the rollout does not depend on the number of slots, the refill order
or the mesh (up to float rounding of the logits in different batch shapes). The log-probs are the
tempered, untruncated distribution's, as the static engine's (`sampling.sample_tokens`). With
temperature 0 every sequence's tokens are the static engine's. The two engines' sampled rollouts
differ: the static engine draws one uniform per step for all rows from `fold_in(rng, t)`.

Shape letters: grpo_jax.shapes (Z row shards, J decode slots per shard, Np prompts per shard,
Rb = Np x G sequences per shard).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.config import SamplingConfig
from grpo_jax.engine.draw import Rollout, rollout_shardings, sample_tokens
from grpo_jax.engine.lockstep import constrain_rows, lockstep_decode
from grpo_jax.engine.routing import expert_buffer, fed_only, record, stored
from grpo_jax.engine.slots import SlotCache
from grpo_jax.engine.state import EngineLoop, EngineState, engine_layout, engine_loop
from grpo_jax.runtime.sharding import batch_sharding, replicated


@functools.lru_cache(maxsize=64)
def continuous_program(graphdef, config: SamplingConfig, mesh: Mesh):
    """The jitted engine: `(model state, ids [N, P], mask [N, P], key) -> (Rollout, stats)`, with
    stats = {"steps", "slot_steps", "useful_slot_steps", "prefill_rows"} (int32 scalars); rows
    split over the mesh's (data, fsdp, expert) in and out, the model state where it was placed (one device:
    a 1x1x1 mesh, `runtime.sharding.one_device_mesh`)."""
    fn = functools.partial(_engine, graphdef, config=config, mesh=mesh)
    rows = batch_sharding(mesh, 2)
    stats = {k: replicated(mesh) for k in ("steps", "slot_steps", "useful_slot_steps", "prefill_rows")}
    return jax.jit(fn, in_shardings=(None, rows, rows, replicated(mesh)),
                   out_shardings=(rollout_shardings(mesh), stats))


def _prompt_logits(prompt_logits_ZNV, prompt_ZJ):
    """The prefill logits [Z, J, V] of each slot's prompt (they draw a sequence's first token)."""
    return jax.vmap(lambda a, i: a[i])(prompt_logits_ZNV, prompt_ZJ)


def start_engine(model, ids_NP, mask_NP, rng, *, config: SamplingConfig,
                 mesh: Mesh) -> tuple[EngineLoop, EngineState]:
    """Prefill the N prompts once each and fill the slots with each shard's first sequences ->
    (the loop's constants, the EngineState)."""
    M = config.max_new_tokens
    lay = engine_layout(ids_NP.shape[0], config, mesh)
    Z, Np, Rb, J = lay.shards, lay.prompts, lay.sequences, lay.slots
    # Once per prompt.
    last_NV, k_LNKPD, v_LNKPD, pmask_NP, ppos_NP, experts_NPLK = model.prefill_kv(ids_NP, mask_NP, with_routing=True,
        row_sharding=batch_sharding(mesh, 1))
    cache = SlotCache.create(k_LNKPD, v_LNKPD, pmask_NP, ppos_NP, shards=Z, slots=J, decode_steps=max(M - 1, 1),
                             phases=config.attend_phases)
    loop = engine_loop(model, config, mesh, lay, cache.chunk_size)
    hold = loop.hold
    rows_ZR = jnp.arange(Z * Rb, dtype=jnp.int32).reshape(Z, Rb)
    # Slot j of every shard starts with the shard's sequence j (if it has that many).
    seq_ZJ = jnp.broadcast_to(jnp.where(jnp.arange(J) < Rb, jnp.arange(J), -1), (Z, J)).astype(jnp.int32)
    prompt_ZJ = jnp.maximum(seq_ZJ, 0) // config.group_size
    last_ZNV = hold(last_NV.reshape(Z, Np, -1))
    st = EngineState(seq=hold(seq_ZJ), cache=jax.tree.map(hold, cache.replace(slot_prompt=prompt_ZJ)),
                     prompt_logits=last_ZNV, logits=hold(_prompt_logits(last_ZNV, prompt_ZJ)),
                     uniforms=hold(sequence_uniforms(rng, rows_ZR, M)) if config.temperature > 0 else None,
                     admitted=jnp.full((Z,), min(J, Rb), jnp.int32), done=jnp.zeros((Z,), jnp.int32),
                     tokens=hold(jnp.full((Z, Rb, M), config.pad_id, jnp.int32)),
                     logprobs=hold(jnp.zeros((Z, Rb, M), jnp.float32)),
                     lengths=hold(jnp.zeros((Z, Rb), jnp.int32)), truncated=hold(jnp.zeros((Z, Rb), jnp.bool_)),
                     steps=jnp.int32(0), useful=jnp.int32(0), slot_steps=jnp.int32(0),
                     prompt_experts=jax.tree.map(lambda x: hold(x.reshape(Z, Np, *x.shape[1:])),
                                                 stored(experts_NPLK, model.config)),
                     experts=jax.tree.map(hold, expert_buffer(model.config, (Z, Rb, M))))
    return loop, st


def _engine(graphdef, state, ids_NP, mask_NP, rng, *, config: SamplingConfig, mesh):
    model = nnx.merge(graphdef, state)
    lay = engine_layout(ids_NP.shape[0], config, mesh)
    if lay.slots >= lay.sequences:
        return every_sequence_at_once(model, ids_NP, mask_NP, rng, config=config, mesh=mesh)
    loop, st = start_engine(model, ids_NP, mask_NP, rng, config=config, mesh=mesh)
    st = drain_loop(loop, st, step=engine_step, running=_running, compact=compact)
    return _rollout(st, ids_NP, mask_NP)


def drain_loop(loop, st, *, step: Callable, running: Callable, compact: Callable):
    """The engine's loop to its end: `step(loop, st)` while `running(loop, narrower, st)`, at each
    width of `drain_widths` in turn, `compact(loop, st, width)` moving the sequences in flight into
    the narrower slots between them (this engine's and the paged engine's)."""
    widths = drain_widths(loop.lay.slots)
    for i, width in enumerate(widths):
        if width < loop.lay.slots:
            loop, st = compact(loop, st, width)
        narrower = widths[i + 1] if i + 1 < len(widths) else 0
        st = jax.lax.while_loop(functools.partial(running, loop, narrower), functools.partial(step, loop), st)
    return st


DRAIN_HALVINGS, DRAIN_MIN_SLOTS = 1, 8


def drain_widths(slots: int) -> tuple[int, ...]:
    """The slots per shard the loop runs with, in turn: all of them, then (from `DRAIN_MIN_SLOTS`
    slots up, at most `DRAIN_HALVINGS` times) half as many, rounded up, once every queue is empty
    and no shard has more sequences in flight than that (`compact`): the drain at the end of a
    call, when the last long sequences run nearly alone, does not pay for the idle slots. Each
    width compiles its own decode step (SmolLM2's compile: 14 s without the drain, 28 s with one
    halving), so one halving only: a second one took utilisation on the long-tailed benchmark from
    91.5% to 94.9% but SmolLM2's compile to 55 s; below 8 slots the drain is too short to pay for a
    compile (benchmarks/RESULTS.md)."""
    widths = [slots]
    while slots >= DRAIN_MIN_SLOTS and len(widths) <= DRAIN_HALVINGS:
        widths.append(-(-widths[-1] // 2))
    return tuple(widths)


def _running(loop: EngineLoop, narrower: int, st: EngineState) -> jax.Array:
    """Go on at this width: sequences are left, and (when a `narrower` width follows) the queues
    are not all empty or some shard has more than `narrower` sequences in flight."""
    left = jnp.any(st.done < loop.lay.sequences)
    if not narrower:
        return left
    in_flight = jnp.max(jnp.sum(st.seq >= 0, axis=1))
    return left & ~(jnp.all(st.admitted >= loop.lay.sequences) & (in_flight <= narrower))


def compact(loop: EngineLoop, st: EngineState, width: int) -> tuple[EngineLoop, EngineState]:
    """Move every shard's sequences in flight (at most `width` each) into its first `width` slots,
    with their generated keys/values, positions and next-token logits, and drop the other slots ->
    (the loop's constants at that width, the loop state). A sequence's draws are its own
    (`sequence_uniforms`), so the move does not change what it samples."""
    Z, J = st.seq.shape
    keep_Zw = jnp.argsort(st.seq < 0, axis=1, stable=True)[:, :width]  # busy slots first, in order

    def take(x_ZJ):  # [Z, J, ...] -> [Z, width, ...]
        return jax.vmap(lambda a, i: a[i])(x_ZJ, keep_Zw)

    def take_rows(x):  # [Z*J, ...] -> [Z*width, ...]
        return take(x.reshape(Z, J, *x.shape[1:])).reshape(Z * width, *x.shape[1:])

    cache = st.cache
    cache = cache.replace(keys=jax.tree.map(take_rows, cache.keys), values=jax.tree.map(take_rows, cache.values),
                          slot_prompt=take(cache.slot_prompt), slot_t=take(cache.slot_t))
    loop = dataclasses.replace(loop, lay=dataclasses.replace(loop.lay, slots=width))
    hold = loop.hold
    return loop, st.replace(seq=hold(take(st.seq)), cache=jax.tree.map(hold, cache), logits=hold(take(st.logits)))


def _rollout(st: EngineState, ids_NP, mask_NP):
    """The loop state's outputs as a Rollout (row r = sequence r of the whole call) and the stats."""
    Z, Rb, M = st.tokens.shape
    R = Z * Rb
    lengths_R = st.lengths.reshape(R)
    mask_RM = (jnp.arange(M)[None] < lengths_R[:, None]).astype(jnp.int32)
    rollout = Rollout(tokens=st.tokens.reshape(R, M), logprobs=st.logprobs.reshape(R, M), mask=mask_RM,
                      lengths=lengths_R, truncated=st.truncated.reshape(R), prompt_ids=ids_NP,
                      prompt_mask=mask_NP, **rollout_experts(st))
    stats = {"steps": st.steps, "slot_steps": st.slot_steps, "useful_slot_steps": st.useful,
             "prefill_rows": jnp.int32(ids_NP.shape[0])}
    return rollout, stats


def rollout_experts(st) -> dict:
    """A loop state's experts (this engine's or the paged engine's) as the Rollout's fields:
    prompt_experts [N, P, L, Kx], experts [R, M, L, Kx] (0 where no token was fed); {} for a dense model."""
    if st.experts is None:
        return {}
    Z, Rb, M = st.tokens.shape
    p = st.prompt_experts
    return {"prompt_experts": p.reshape(-1, *p.shape[2:]),
            "experts": fed_only(st.experts.reshape(Z * Rb, M, *st.experts.shape[3:]), st.lengths.reshape(Z * Rb))}


def every_sequence_at_once(model, ids_NP, mask_NP, rng, *, config: SamplingConfig, mesh: Mesh):
    """Every sequence has a slot from the start (slots >= sequences on every shard): nothing can be
    refilled, so the engine is the lock-step loop (grpo_jax.engine.lockstep), which reads each
    prompt once per group of G rows instead of once per slot, drawing with each sequence's own
    uniforms: the rollout the slot loop would draw."""
    R = ids_NP.shape[0] * config.group_size
    uniforms_RM = None
    if config.temperature > 0:
        uniforms_RM = constrain_rows(sequence_uniforms(rng, jnp.arange(R, dtype=jnp.int32), config.max_new_tokens),
                                     mesh)
    rollout, steps = lockstep_decode(model, ids_NP, mask_NP, rng, config=config, mesh=mesh, uniforms_RM=uniforms_RM)
    stats = {"steps": steps, "slot_steps": steps * R, "useful_slot_steps": rollout.lengths.sum(),
             "prefill_rows": jnp.int32(ids_NP.shape[0])}
    return rollout, stats


def sequence_uniforms(rng: jax.Array, rows: jax.Array, max_new_tokens: int) -> jax.Array:
    """float32 [..., M]: the uniforms that draw tokens 0..M-1 of the sequences in `rows` (int, any
    shape; a row of the whole rollout): row r's are uniform(fold_in(rng, r), (M,)), its own, so a
    sequence's draws do not depend on where or when it runs."""
    draw = jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(rng, r), (max_new_tokens,)))
    return draw(rows.reshape(-1)).reshape(*rows.shape, max_new_tokens)


def draw_next(loop: EngineLoop, st: EngineState) -> tuple[jax.Array, jax.Array]:
    """Every slot's next token and its log-prob [Z, J]: a sequence's token t takes the t-th of its
    own uniforms (`sequence_uniforms`, drawn once per call: no random program runs per step)."""
    config = loop.config
    Z, J = st.seq.shape
    V = st.logits.shape[-1]
    t_ZJ = st.cache.slot_t
    uniforms_X = None
    if config.temperature > 0:
        at_ZJ = jnp.maximum(st.seq, 0)
        uniforms_X = jax.vmap(lambda u, s, t: u[s, jnp.minimum(t, u.shape[-1] - 1)])(st.uniforms, at_ZJ, t_ZJ)
    banned_XV = None
    if config.min_new_tokens:
        stop_V = jnp.isin(jnp.arange(V), jnp.asarray(config.stop_token_ids or (-1,), jnp.int32))
        banned_XV = stop_V[None] & (t_ZJ.reshape(-1, 1) < config.min_new_tokens)
    tok_X, logp_X = sample_tokens(st.logits.reshape(-1, V), None, temperature=config.temperature,
                                  top_k=config.top_k, top_p=config.top_p, banned=banned_XV,
                                  uniforms=None if uniforms_X is None else uniforms_X.reshape(-1))
    return tok_X.reshape(Z, J), logp_X.reshape(Z, J)


def draw_and_record(loop, st) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """Draw every occupied slot's next token and record it in its sequence's row -> (tokens
    [Z, J], finished [Z, J] (a stop token, or max_new_tokens reached), the outputs tokens,
    logprobs, lengths and truncated with the draws written). `st`: this engine's or the paged
    engine's state (seq, cache.slot_t, the outputs)."""
    config, Rb = loop.config, loop.lay.sequences
    seq_ZJ, t_ZJ = st.seq, st.cache.slot_t
    z_Z1 = jnp.arange(seq_ZJ.shape[0], dtype=jnp.int32)[:, None]
    active_ZJ = seq_ZJ >= 0
    tok_ZJ, logp_ZJ = draw_next(loop, st)
    at_ZJ = jnp.where(active_ZJ, seq_ZJ, Rb)  # an empty slot's writes fall outside and are dropped
    tokens = st.tokens.at[z_Z1, at_ZJ, t_ZJ].set(tok_ZJ, mode="drop")
    logprobs = st.logprobs.at[z_Z1, at_ZJ, t_ZJ].set(logp_ZJ, mode="drop")
    stopped_ZJ = jnp.isin(tok_ZJ, jnp.asarray(config.stop_token_ids or (-1,), jnp.int32))
    finished_ZJ = active_ZJ & (stopped_ZJ | (t_ZJ + 1 >= config.max_new_tokens))
    ended_ZJ = jnp.where(finished_ZJ, seq_ZJ, Rb)
    lengths = st.lengths.at[z_Z1, ended_ZJ].set(t_ZJ + 1, mode="drop")
    truncated = st.truncated.at[z_Z1, ended_ZJ].set(~stopped_ZJ, mode="drop")
    return tok_ZJ, finished_ZJ, (tokens, logprobs, lengths, truncated)


def engine_step(loop: EngineLoop, st: EngineState) -> EngineState:
    """One engine step: draw, record, decode the continuing slots, refill the free ones."""
    hold = loop.hold
    seq_ZJ, cache = st.seq, st.cache
    active_ZJ, t_ZJ = seq_ZJ >= 0, cache.slot_t  # slot_t: the index of the token drawn now
    tok_ZJ, finished_ZJ, (tokens, logprobs, lengths, truncated) = draw_and_record(loop, st)

    # Feed the continuing slots' tokens (the others feed into slot 0 of a block nobody reads).
    going_ZJ = active_ZJ & ~finished_ZJ
    cache = cache.replace(slot_t=jnp.where(going_ZJ, t_ZJ, 0))
    phase = jnp.max(jnp.where(going_ZJ, t_ZJ, 0)) // loop.phase_size
    logits_ZJV, cache, experts_ZJLK = loop.decode(tok_ZJ, cache, phase=phase)
    st = st.replace(experts=record(st.experts, experts_ZJLK, seq_ZJ, t_ZJ, going_ZJ))

    st, _ = refill(loop, st, seq_ZJ, cache, logits_ZJV, finished_ZJ)
    return st.replace(tokens=hold(tokens), logprobs=hold(logprobs), lengths=hold(lengths), truncated=hold(truncated),
                      steps=st.steps + 1, useful=st.useful + active_ZJ.sum(dtype=jnp.int32),
                      slot_steps=st.slot_steps + active_ZJ.size)


def refill(loop: EngineLoop, st: EngineState, seq_ZJ, cache: SlotCache, logits_ZJV,
           finished_ZJ) -> tuple[EngineState, jax.Array]:
    """The loop state with the sequences in `finished_ZJ` counted done and every free slot (theirs
    and the empty ones), in slot order, refilled with its shard's next waiting sequence: its
    prompt's logits draw its first token, its generated block starts at 0."""
    hold, Rb, G = loop.hold, loop.lay.sequences, loop.config.group_size
    free_ZJ = finished_ZJ | (seq_ZJ < 0)
    new_ZJ = st.admitted[:, None] + jnp.cumsum(free_ZJ, axis=1, dtype=jnp.int32) - 1
    fill_ZJ = free_ZJ & (new_ZJ < Rb)
    seq_ZJ = jnp.where(fill_ZJ, new_ZJ, jnp.where(finished_ZJ, -1, seq_ZJ))
    prompt_ZJ = jnp.where(fill_ZJ, new_ZJ // G, cache.slot_prompt)
    cache = cache.replace(slot_prompt=prompt_ZJ, slot_t=jnp.where(fill_ZJ, 0, cache.slot_t))
    logits_ZJV = jnp.where(fill_ZJ[..., None], _prompt_logits(st.prompt_logits, prompt_ZJ), logits_ZJV)
    st = st.replace(seq=hold(seq_ZJ), cache=jax.tree.map(hold, cache), logits=hold(logits_ZJV),
                    admitted=st.admitted + fill_ZJ.sum(axis=1, dtype=jnp.int32),
                    done=st.done + finished_ZJ.sum(axis=1, dtype=jnp.int32))
    return st, fill_ZJ
