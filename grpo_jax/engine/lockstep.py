"""The lock-step decode loop: every row of a call decodes together until the longest is done.

The static engine (`sampling.engine: static`) is this loop with one uniform per step for all rows
(`fold_in(rng, t)`). The paged engine runs it too when every sequence has its own decode slot
from the start (slots >= sequences on every shard) and the cache bytes hold them all at
max_new_tokens: nothing can then be refilled or paged, and the lock-step loop reads each prompt's
keys and values once per group of G rows where the slot loop reads them once per slot. It then
passes each sequence's own uniforms (`every_sequence_at_once`), so its rollout is the one the slot
loop draws (see grpo_jax.engine.paged).

Shape suffixes: N prompts, P prompt bucket, G group size, R = N*G rows, M max_new_tokens, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.config import SamplingConfig
from grpo_jax.engine.draw import Rollout, rollout_shardings, sample_tokens, sequence_uniforms
from grpo_jax.engine.routing import expert_buffer, stored
from grpo_jax.runtime.sharding import BATCH, batch_sharding, replicated


def prefill_rows(model, ids_NP, mask_NP, config: SamplingConfig, share_prefill: bool, mesh: Mesh):
    """The prompts' pass -> (the logits [R, V] that draw token 0, the cache sized for the decode,
    the prompts' experts [N, P, L, Kx] in the stored dtype, None for a dense model)."""
    G, M = config.group_size, config.max_new_tokens
    # Token t (t < M - 1) is fed back as decode step t; the last sampled token never is.
    spec = dict(decode_steps=M - 1, chunks=config.attend_phases, last_only=True, with_routing=True,
                row_sharding=batch_sharding(mesh, 1))
    if share_prefill:
        # N rows: the prompt's keys/values stay one copy per group (the decode attends them per group).
        logits_N1V, cache, experts_NPLK = model.prefill(ids_NP, mask_NP, group_size=G, **spec)
        last_RV = jnp.repeat(logits_N1V[:, 0], G, axis=0)
    else:
        logits_R1V, cache, experts_RPLK = model.prefill(jnp.repeat(ids_NP, G, axis=0), jnp.repeat(mask_NP, G, axis=0),
                                                        **spec)
        last_RV = logits_R1V[:, 0]
        # Every row of a group ran the same prompt: its first row's experts are the group's.
        experts_NPLK = None if experts_RPLK is None else experts_RPLK[::G]
    # Keep the cache's rows where their prompts' rows are, for the whole loop.
    return constrain_rows(last_RV, mesh), constrain_rows(cache, mesh), stored(experts_NPLK, model.config)


def lockstep_decode(model, ids_NP, mask_NP, rng, *, config: SamplingConfig, mesh: Mesh, share_prefill: bool = True,
                    uniforms_RM: jax.Array | None = None) -> tuple[Rollout, jax.Array]:
    """Prefill and decode every row at once -> (Rollout, the number of draw steps run, int32).
    `uniforms_RM` (float32 [R, M]): row r draws token t with uniforms_RM[r, t] instead of the
    step's shared key `fold_in(rng, t)`."""
    M = config.max_new_tokens
    last_RV, cache, prompt_experts = prefill_rows(model, ids_NP, mask_NP, config, share_prefill, mesh)
    emit = emitter(config, rng, uniforms_RM)
    R = cache.rows
    tokens_RM = jnp.full((R, M), config.pad_id, jnp.int32)
    logprobs_RM = jnp.zeros((R, M), jnp.float32)
    done_R = jnp.zeros((R,), jnp.bool_)
    # mask_RM[:, t] = the row was still running when token t was emitted.
    running_RM = jnp.zeros((R, M), jnp.bool_).at[:, 0].set(True)
    experts_RMLK = constrain_rows(expert_buffer(model.config, (R, M)), mesh)
    tok_R, done_R, tokens_RM, logprobs_RM = emit(0, last_RV, done_R, tokens_RM, logprobs_RM)

    # Step t (1 <= t < M) feeds token t - 1 (decode step t - 1). Chunk c of the cache's generated
    # slots is one while_loop (static shapes: it attends the prompt and chunks 0..c only).
    weights = model.layer_weights()
    carry = (jnp.int32(1), tok_R, done_R, tokens_RM, logprobs_RM, running_RM, experts_RMLK, cache)
    for c in range(cache.num_chunks):
        def cond(carry, end=min((c + 1) * cache.chunk_size, M - 1) + 1):
            t, _, done_R, *_ = carry
            return (t < end) & ~jnp.all(done_R)

        def body(carry, c=c):
            t, tok_R, done_R, tokens_RM, logprobs_RM, running_RM, experts_RMLK, cache = carry
            running_RM = running_RM.at[:, t].set(~done_R)
            logits_RV, cache, experts_RLK = model.decode_step(tok_R, cache, chunk=c, weights=weights, mesh=mesh,
                                                              with_routing=True)
            if experts_RMLK is not None:  # token t - 1 was fed for the rows still running
                fed_RLK = jnp.where(done_R[:, None, None], 0, experts_RLK).astype(experts_RMLK.dtype)
                experts_RMLK = experts_RMLK.at[:, t - 1].set(fed_RLK)
            tok_R, done_R, tokens_RM, logprobs_RM = emit(t, logits_RV, done_R, tokens_RM, logprobs_RM)
            return t + 1, tok_R, done_R, tokens_RM, logprobs_RM, running_RM, experts_RMLK, cache

        carry = jax.lax.while_loop(cond, body, carry)
    steps, _, done_R, tokens_RM, logprobs_RM, running_RM, experts_RMLK = carry[:7]
    mask_RM = running_RM.astype(jnp.int32)
    rollout = Rollout(tokens=tokens_RM, logprobs=logprobs_RM, mask=mask_RM, lengths=mask_RM.sum(axis=1),
                      truncated=~done_R, prompt_ids=ids_NP, prompt_mask=mask_NP, prompt_experts=prompt_experts,
                      experts=experts_RMLK)
    return rollout, steps


def emitter(config: SamplingConfig, rng, uniforms_RM: jax.Array | None):
    """`emit(t, logits [R, V], done [R], tokens [R, M], logprobs [R, M])`: draw token t of every row
    (pad and log-prob 0 for the rows done) and record it -> (tokens [R], done, tokens, logprobs)."""
    M = config.max_new_tokens
    stop_ids = jnp.asarray(config.stop_token_ids or (-1,), jnp.int32)
    sample = functools.partial(sample_tokens, temperature=config.temperature, top_k=config.top_k,
                               top_p=config.top_p)
    per_row = uniforms_RM is not None and config.temperature > 0

    def emit(t, last_RV, done_R, tokens_RM, logprobs_RM):
        # Before min_new_tokens, stop tokens cannot be drawn (a benchmark's fixed-length completions).
        banned_V = (jnp.isin(jnp.arange(last_RV.shape[-1]), stop_ids) & (t < config.min_new_tokens)
                    if config.min_new_tokens else None)
        if per_row:
            u_R = jax.lax.dynamic_index_in_dim(uniforms_RM, jnp.minimum(t, M - 1), axis=1, keepdims=False)
            tok_R, logp_R = sample(last_RV, None, banned=banned_V, uniforms=u_R)
        else:
            tok_R, logp_R = sample(last_RV, jax.random.fold_in(rng, t), banned=banned_V)
        tok_R = jnp.where(done_R, config.pad_id, tok_R)
        logp_R = jnp.where(done_R, 0.0, logp_R)
        tokens_RM = tokens_RM.at[:, t].set(tok_R)
        logprobs_RM = logprobs_RM.at[:, t].set(logp_R)
        done_R = done_R | jnp.isin(tok_R, stop_ids)
        return tok_R, done_R, tokens_RM, logprobs_RM

    return emit


def constrain_rows(tree, mesh):
    """with_sharding_constraint splitting each array's leading (row) axis over the batch mesh axes:
    every buffer of the KVCache and the logits have rows first."""
    def one(x):
        if x.ndim == 0:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(BATCH)))

    return jax.tree.map(one, tree)


@functools.lru_cache(maxsize=64)
def static_program(graphdef, config: SamplingConfig, share_prefill: bool, mesh: Mesh):
    """The jitted static engine `generate` runs on `mesh`: `(model state, ids [N, P], mask [N, P],
    key) -> (Rollout, {})` (it counts nothing), rows split over (data, fsdp, expert), the model state where it was placed. Its `.lower` with
    jax.ShapeDtypeStructs (each state leaf carrying its sharding) shows its memory before any
    parameter exists (`grpo-jax bench memory`)."""
    rows = batch_sharding(mesh, 2)
    # The state's shardings are left unspecified: the params keep the placement they arrive with.
    return jax.jit(functools.partial(_static, graphdef, config=config, share_prefill=share_prefill, mesh=mesh),
                   in_shardings=(None, rows, rows, replicated(mesh)), out_shardings=(rollout_shardings(mesh), {}))


def _static(graphdef, state, ids_NP, mask_NP, rng, *, config: SamplingConfig, share_prefill: bool,
            mesh: Mesh) -> tuple[Rollout, dict]:
    return lockstep_decode(nnx.merge(graphdef, state), ids_NP, mask_NP, rng, config=config,
                           share_prefill=share_prefill, mesh=mesh)[0], {}


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
