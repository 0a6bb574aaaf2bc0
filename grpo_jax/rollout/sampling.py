"""Group sampling: G completions per prompt from one shared prefill, decoded in one jitted loop.

`generate(model, prompts, config, rng) -> Rollout`. Row i*G + j of every output is sample j of
prompt i. Shape suffixes here: N prompts, P prompt bucket, G group size, R = N*G rows,
M max_new_tokens, V vocab.

How it runs:
- Prompts are left-padded to the smallest bucket of `config.prompt_buckets` that fits the longest
  one, so a run compiles at most one program per bucket (len(prompt_buckets) programs for a fixed
  number of prompts and a fixed SamplingConfig).
- Each distinct prompt is prefilled once ([N, P] tokens, `Transformer.prefill`) into the model's
  cache (`grpo_jax.models.cache.KVCache`), whose prompt block is never copied to the G rows: the
  decode attends it once per group (only the last logits and the small per-slot mask/position
  vectors are repeated to the N*G rows). Prefill cost and prompt cache memory do not grow with G.
- Decoding runs in the same jit: sample a token for every row, feed it back through
  `Transformer.decode_step`, stop as soon as every row has emitted a stop token or `max_new_tokens`
  are done. The generated slots are `attend_phases` chunks of the cache; chunk c is one
  `lax.while_loop` (static shapes) that writes chunk c in place and attends the prompt and chunks
  0..c only, so early steps do not pay for the whole capacity (each chunk compiles one more step).

Log-probabilities: `logprobs[r, t]` is log softmax(logits / temperature) at the sampled token, the
distribution the trainer recomputes. top-k / top-p only restrict which tokens can be drawn (the
draw is from the renormalised, truncated distribution); the reported log-prob stays that of the
untruncated tempered distribution, so it matches the trainer's recomputation exactly. With
temperature 0 (greedy) the log-prob is that of the untempered distribution.
Per-step randomness is `fold_in(rng, step)`: the same rng gives the same rollout.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.config import SamplingConfig
from grpo_jax.runtime.hosts import replicated_key
from grpo_jax.models.transformer import Transformer
from grpo_jax.rollout.draw import Rollout, sample_tokens
from grpo_jax.rollout.engine import continuous_program
from grpo_jax.runtime.sharding import BATCH, batch_sharding, replicated, shard_rows


def pad_prompts(prompts: Sequence[Sequence[int]], buckets: Sequence[int], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token-id lists to the smallest bucket that fits the longest -> (ids [N, P], mask [N, P])."""
    if not len(prompts):
        raise ValueError("generate() needs at least one prompt")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token")
    longest = max(lengths)
    fitting = [b for b in sorted(buckets) if b >= longest]
    if not fitting:
        raise ValueError(
            f"a prompt has {longest} tokens, more than the largest prompt bucket {max(buckets)}; "
            "raise sampling.prompt_buckets or filter long prompts before sampling"
        )
    P = fitting[0]
    ids = np.full((len(prompts), P), pad_id, np.int32)
    mask = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = p
        mask[i, P - len(p):] = 1
    return ids, mask


def generate(model: Transformer, prompts, config: SamplingConfig, rng: jax.Array, *,
             share_prefill: bool = True, mesh=None) -> Rollout:
    """Sample `config.group_size` completions for each prompt -> Rollout (R = N*G rows; see `Rollout`).

    `prompts` is a list of N token-id lists, or a tuple (ids [N, P], mask [N, P]) of integers already
    left-padded (P should then be one of the buckets to bound compiles); bad shapes or dtypes raise
    ValueError, and so does a malformed result (`check_rollout`). `share_prefill=False` is the reference
    path that repeats every prompt G times before prefill; it exists to test and benchmark the
    shared path and gives the same rollout.

    With a `mesh` (grpo_jax.runtime.sharding), prompts and every output row are split over (data, fsdp)
    (N must be a multiple of data x fsdp), the KV cache rows follow, and the model's parameters
    keep the shardings they were placed with; all of it stays on device inside the loop. On several
    hosts, pass either the same host arrays on every host or global arrays built from each host's
    rows (`grpo_jax.runtime.hosts.to_global`), and read the outputs with `grpo_jax.runtime.hosts.local_rows`.
    """
    ids, mask = _prompt_arrays(prompts, config)
    graphdef, state = nnx.split(model)
    if config.engine == "continuous":
        if mesh is not None:
            ids, mask = shard_rows((ids, mask), mesh)
            rng = replicated_key(rng, mesh)
        rollout, _ = continuous_program(graphdef, config, mesh)(state, ids, mask, rng)
    elif mesh is None:
        rollout = _generate(graphdef, state, jnp.asarray(ids), jnp.asarray(mask), rng, config, share_prefill)
    else:
        ids, mask = shard_rows((ids, mask), mesh)  # global arrays (grpo_jax.runtime.hosts.to_global) stay where they are
        rollout = sharded_generate(graphdef, config, share_prefill, mesh)(state, ids, mask, replicated_key(rng, mesh))
    check_rollout(rollout, rows=ids.shape[0] * config.group_size, max_new_tokens=config.max_new_tokens)
    return rollout


def _prompt_arrays(prompts, config: SamplingConfig):
    """(ids [N, P], mask [N, P]) int32 from token-id lists, or from a checked (ids, mask) pair."""
    if not (isinstance(prompts, tuple) and len(prompts) == 2 and hasattr(prompts[0], "shape")):
        return pad_prompts(prompts, config.prompt_buckets, config.pad_id)
    ids, mask = prompts
    for name, x, kinds in (("prompt ids", ids, "iu"), ("prompt mask", mask, "iub")):
        if np.dtype(x.dtype).kind not in kinds:
            raise ValueError(f"generate(): {name} must be {'integer' if kinds == 'iu' else 'integer or bool'}, "
                             f"got dtype {x.dtype}")
    _check("prompt ids", chex.assert_rank, ids, 2)
    _check("prompt mask", chex.assert_shape, mask, tuple(ids.shape))
    if not isinstance(ids, jax.Array):
        return np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    # Global arrays of several hosts stay untouched when they already are int32.
    return tuple(x if x.dtype == jnp.int32 else x.astype(jnp.int32) for x in (ids, mask))


def check_rollout(rollout: Rollout, *, rows: int, max_new_tokens: int) -> None:
    """Raise ValueError naming the field if `rollout` is not R = `rows` rows of `max_new_tokens`
    completion slots with the documented dtypes (see `Rollout`); prompts [N, P] with N dividing R."""
    M = max_new_tokens
    expected = (("tokens", (rows, M), jnp.int32), ("logprobs", (rows, M), jnp.float32), ("mask", (rows, M), jnp.int32),
                ("lengths", (rows,), jnp.int32), ("truncated", (rows,), jnp.bool_))
    for name, shape, dtype in expected:
        _check(f"Rollout.{name}", chex.assert_shape, getattr(rollout, name), shape)
        _check(f"Rollout.{name}", chex.assert_type, getattr(rollout, name), dtype)
    for name in ("prompt_ids", "prompt_mask"):
        x = getattr(rollout, name)
        _check(f"Rollout.{name}", chex.assert_rank, x, 2)
        _check(f"Rollout.{name}", chex.assert_type, x, jnp.int32)
        if rows % x.shape[0]:
            raise ValueError(f"Rollout.{name}: {x.shape[0]} prompts do not divide the {rows} completion rows")
    _check("Rollout.prompt_mask", chex.assert_equal_shape, [rollout.prompt_mask, rollout.prompt_ids])


def _check(field: str, assertion, *args) -> None:
    """Run a chex assertion; its failure becomes a ValueError that names the field."""
    try:
        assertion(*args)
    except AssertionError as e:
        raise ValueError(f"{field}: {e}") from None


@functools.lru_cache(maxsize=64)
def sharded_generate(graphdef, config: SamplingConfig, share_prefill: bool, mesh):
    """The jitted sampler `generate` runs on `mesh`: `(model state, ids [N, P], mask [N, P], key) ->
    Rollout`, rows split over (data, fsdp), the model state where it was placed. Its `.lower` with
    jax.ShapeDtypeStructs (each state leaf carrying its sharding) shows its memory before any
    parameter exists (`grpo-jax bench memory`)."""
    def rows(ndim):
        return batch_sharding(mesh, ndim)

    out = Rollout(tokens=rows(2), logprobs=rows(2), mask=rows(2), lengths=rows(1), truncated=rows(1),
                  prompt_ids=rows(2), prompt_mask=rows(2))
    # The state's shardings are left unspecified: the params keep the placement they arrive with.
    return jax.jit(functools.partial(_generate_impl, graphdef, config=config, share_prefill=share_prefill, mesh=mesh),
                   in_shardings=(None, rows(2), rows(2), replicated(mesh)), out_shardings=out)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _generate(graphdef, state, ids_NP, mask_NP, rng, config: SamplingConfig, share_prefill: bool) -> Rollout:
    return _generate_impl(graphdef, state, ids_NP, mask_NP, rng, config=config, share_prefill=share_prefill)


def _prefill(model, ids_NP, mask_NP, config: SamplingConfig, share_prefill: bool, mesh):
    """The prompts' pass -> (the logits [R, V] that draw token 0, the cache sized for the decode)."""
    G, M = config.group_size, config.max_new_tokens
    # Token t (t < M - 1) is fed back as decode step t; the last sampled token never is.
    spec = dict(decode_steps=M - 1, chunks=config.attend_phases, last_only=True)
    if share_prefill:
        # N rows: the prompt's keys/values stay one copy per group (the decode attends them per group).
        logits_N1V, cache = model.prefill(ids_NP, mask_NP, group_size=G, **spec)
        last_RV = jnp.repeat(logits_N1V[:, 0], G, axis=0)
    else:
        logits_R1V, cache = model.prefill(jnp.repeat(ids_NP, G, axis=0), jnp.repeat(mask_NP, G, axis=0), **spec)
        last_RV = logits_R1V[:, 0]
    if mesh is not None:
        # Keep the cache's rows where their prompts' rows are, for the whole loop.
        cache = _constrain_rows(cache, mesh, BATCH)
        last_RV = _constrain_rows(last_RV, mesh, BATCH)
    return last_RV, cache


def _generate_impl(graphdef, state, ids_NP, mask_NP, rng, *, config: SamplingConfig, share_prefill: bool,
                   mesh=None) -> Rollout:
    model = nnx.merge(graphdef, state)
    M = config.max_new_tokens
    last_RV, cache = _prefill(model, ids_NP, mask_NP, config, share_prefill, mesh)
    stop_ids = jnp.asarray(config.stop_token_ids or (-1,), jnp.int32)
    sample = functools.partial(sample_tokens, temperature=config.temperature, top_k=config.top_k,
                               top_p=config.top_p)

    def emit(t, last_RV, done_R, tokens_RM, logprobs_RM):
        # Before min_new_tokens, stop tokens cannot be drawn (a benchmark's fixed-length completions).
        banned_V = (jnp.isin(jnp.arange(last_RV.shape[-1]), stop_ids) & (t < config.min_new_tokens)
                    if config.min_new_tokens else None)
        tok_R, logp_R = sample(last_RV, jax.random.fold_in(rng, t), banned=banned_V)
        tok_R = jnp.where(done_R, config.pad_id, tok_R)
        logp_R = jnp.where(done_R, 0.0, logp_R)
        tokens_RM = tokens_RM.at[:, t].set(tok_R)
        logprobs_RM = logprobs_RM.at[:, t].set(logp_R)
        done_R = done_R | jnp.isin(tok_R, stop_ids)
        return tok_R, done_R, tokens_RM, logprobs_RM

    R = cache.rows
    tokens_RM = jnp.full((R, M), config.pad_id, jnp.int32)
    logprobs_RM = jnp.zeros((R, M), jnp.float32)
    done_R = jnp.zeros((R,), jnp.bool_)
    # mask_RM[:, t] = the row was still running when token t was emitted.
    running_RM = jnp.zeros((R, M), jnp.bool_).at[:, 0].set(True)
    tok_R, done_R, tokens_RM, logprobs_RM = emit(0, last_RV, done_R, tokens_RM, logprobs_RM)

    # Step t (1 <= t < M) feeds token t - 1 (decode step t - 1). Chunk c of the cache's generated
    # slots is one while_loop (static shapes: it attends the prompt and chunks 0..c only).
    weights = model.layer_weights()
    carry = (jnp.int32(1), tok_R, done_R, tokens_RM, logprobs_RM, running_RM, cache)
    for c in range(cache.num_chunks):
        def cond(carry, end=min((c + 1) * cache.chunk_size, M - 1) + 1):
            t, _, done_R, *_ = carry
            return (t < end) & ~jnp.all(done_R)

        def body(carry, c=c):
            t, tok_R, done_R, tokens_RM, logprobs_RM, running_RM, cache = carry
            running_RM = running_RM.at[:, t].set(~done_R)
            logits_RV, cache = model.decode_step(tok_R, cache, chunk=c, weights=weights)
            tok_R, done_R, tokens_RM, logprobs_RM = emit(t, logits_RV, done_R, tokens_RM, logprobs_RM)
            return t + 1, tok_R, done_R, tokens_RM, logprobs_RM, running_RM, cache

        carry = jax.lax.while_loop(cond, body, carry)
    done_R, tokens_RM, logprobs_RM, running_RM = carry[2:6]
    mask_RM = running_RM.astype(jnp.int32)
    return Rollout(tokens=tokens_RM, logprobs=logprobs_RM, mask=mask_RM, lengths=mask_RM.sum(axis=1),
                   truncated=~done_R, prompt_ids=ids_NP, prompt_mask=mask_NP)


def _constrain_rows(tree, mesh, batch_axes):
    """with_sharding_constraint splitting each array's leading (row) axis over the batch mesh axes:
    every buffer of the KVCache and the logits have rows first."""
    def one(x):
        if x.ndim == 0:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(batch_axes)))

    return jax.tree.map(one, tree)
