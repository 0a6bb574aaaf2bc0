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

from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.config import SamplingConfig
from grpo_jax.runtime.hosts import replicated_key
from grpo_jax.models.transformer import Transformer
from grpo_jax.engine.draw import Rollout, sample_tokens  # noqa: F401 - sample_tokens re-exported
from grpo_jax.engine.engines import engine_of
from grpo_jax.runtime.sharding import mesh_or_one_device, pow2_bucket, round_to_row_shards, shard_rows


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

    With a `mesh` (grpo_jax.runtime.sharding), prompts and every output row are split over (data, fsdp, expert)
    (N must be a multiple of data x fsdp x expert), the KV cache rows follow, and the model's parameters
    keep the shardings they were placed with; all of it stays on device inside the loop. Without
    one, the call runs on the 1x1x1 mesh of the model's device (`one_device_mesh`). On several
    hosts, pass either the same host arrays on every host or global arrays built from each host's
    rows (`grpo_jax.runtime.hosts.to_global`), and read the outputs with `grpo_jax.runtime.hosts.local_rows`.
    """
    return generate_with_stats(model, prompts, config, rng, share_prefill=share_prefill, mesh=mesh)[0]


def generate_with_stats(model: Transformer, prompts, config: SamplingConfig, rng: jax.Array, *,
                        share_prefill: bool = True, mesh=None) -> tuple[Rollout, dict]:
    """`generate`, and the engine's own counts (int32 scalars on device; {} for the static engine):
    steps, slot-steps, useful slot-steps, and for the paged engine its preemptions, recomputed
    tokens and pages held (`engine.paged.STATS`)."""
    engine = engine_of(config)
    if not share_prefill and engine.slots:
        raise ValueError(f"share_prefill=False is the static engine's reference path (every prompt repeated G times "
                         f"before prefill); the {engine.name} engine always prefills each prompt once: pass a config "
                         "with engine='static'")
    ids, mask = _prompt_arrays(prompts, config)
    graphdef, state = nnx.split(model)
    mesh = mesh_or_one_device(mesh, state)
    ids, mask = shard_rows((ids, mask), mesh)  # global arrays (grpo_jax.runtime.hosts.to_global) stay where they are
    rng = replicated_key(rng, mesh)
    rollout, stats = engine.program(graphdef, config, mesh, share_prefill=share_prefill)(state, ids, mask, rng)
    check_rollout(rollout, rows=ids.shape[0] * config.group_size, max_new_tokens=config.max_new_tokens)
    return rollout, stats


def engine_metrics(stats: dict) -> dict[str, float]:
    """The run's `engine/*` metrics of one call's paged-engine counts: `engine/preemptions` and
    `engine/pages_used_frac` (pool pages held, averaged over the loop's steps; absent when the call
    ran the lock-step loop, which has no pages); {} for other engines."""
    if "preemptions" not in stats:
        return {}
    s = {k: int(v) for k, v in jax.device_get(stats).items()}
    out = {"engine/preemptions": float(s["preemptions"])}
    if s["pool_pages"]:
        out["engine/pages_used_frac"] = s["page_steps"] / max(s["steps"] * s["pool_pages"] * s["shards"], 1)
    return out


def greedy_completions(model: Transformer, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int,
                       stop_token_ids: Sequence[int], pad_id: int, batch_size: int, mesh=None) -> list[list[int]]:
    """Each prompt's greedy completion (token ids, up to a stop token or `max_new_tokens`), in
    fixed batches of `batch_size` prompts (rounded up to the mesh's row shards; the last padded
    with copies of the first) and power-of-two prompt buckets: one compile per bucket. What a
    judge model (grpo_jax.rewards.llm_judge) writes its verdicts with."""
    mesh = mesh_or_one_device(mesh, nnx.state(model))
    bucket = pow2_bucket(max(len(p) for p in prompt_ids), 16)
    sampling = SamplingConfig(group_size=1, max_new_tokens=max_new_tokens, temperature=0.0,
                              prompt_buckets=(bucket,), stop_token_ids=tuple(stop_token_ids), pad_token_id=pad_id)
    B = round_to_row_shards(batch_size, mesh)
    out: list[list[int]] = []
    for start in range(0, len(prompt_ids), B):
        chunk = [list(p) for p in prompt_ids[start:start + B]]
        real = len(chunk)
        chunk += [chunk[0]] * (B - real)  # a fixed batch: one compiled shape
        rollout = generate(model, chunk, sampling, jax.random.key(0), mesh=mesh)
        tokens, lengths = jax.device_get((rollout.tokens, rollout.lengths))
        out += [[int(t) for t in tokens[i, :lengths[i]]] for i in range(real)]
    return out


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
    completion slots with the documented dtypes (see `Rollout`); prompts [N, P] with N dividing R;
    a mixture-of-experts model's experts [N, P, L, Kx] and [R, M, L, Kx] (both or neither)."""
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
    _check_experts(rollout, rows=rows, max_new_tokens=M)


def _check_experts(rollout: Rollout, *, rows: int, max_new_tokens: int) -> None:
    prompt, completion = rollout.prompt_experts, rollout.experts
    if prompt is None and completion is None:
        return
    if prompt is None or completion is None:
        raise ValueError("Rollout.prompt_experts and Rollout.experts: a mixture-of-experts rollout has both, "
                         f"got {'experts' if prompt is None else 'prompt_experts'} alone")
    _check("Rollout.experts", chex.assert_rank, completion, 4)
    L, K = completion.shape[2:]
    _check("Rollout.experts", chex.assert_shape, completion, (rows, max_new_tokens, L, K))
    _check("Rollout.prompt_experts", chex.assert_shape, prompt, (*rollout.prompt_ids.shape, L, K))
    for name, x in (("prompt_experts", prompt), ("experts", completion)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"Rollout.{name}: expert ids must be integers, got dtype {x.dtype}")


def _check(field: str, assertion, *args) -> None:
    """Run a chex assertion; its failure becomes a ValueError that names the field."""
    try:
        assertion(*args)
    except AssertionError as e:
        raise ValueError(f"{field}: {e}") from None
