"""One decode step of each rollout engine at equal rows and attended length (issue 27): the static
engine's `Transformer.decode_step` in chunk c against the continuous engine's `slot_decode_step` in
phase c (slots = rows, slot j decoding from prompt j // G, every slot at the same step), C steps
inside one jit each on a cache built before the timer starts (donated, and returned so it is
updated in place); the minimum of 3 calls after a warm-up. Every
generated chunk of both caches holds random keys and values (`noisy`): a chunk the loop never
writes would otherwise stay zeros, which XLA folds into one shared broadcast that sits in the CPU's
cache (before 2026-12-02 the static engine's earlier chunks did, and its later phases looked 2x
cheaper than they are).

    python benchmarks/engine_step_cost.py benchmarks/configs/peers.yaml sampling.slots=64

Arguments: a run config and `--set`-style overrides; rows = sampling.slots.
"""

import functools
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.engine.slots import SlotCache, slot_decode_step
from grpo_jax.tools.bench.engine_runs import load_workload


def noisy(cache):
    """The cache with every generated chunk's keys and values drawn at random (inside the jit, so
    XLA cannot fold them into constants)."""
    leaves, tree = jax.tree.flatten((cache.keys, cache.values))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    filled = [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    k, v = jax.tree.unflatten(tree, filled)
    return cache.replace(keys=k, values=v)


def main(config_path, overrides):
    w = load_workload(config_path, overrides)
    G, M, phases = w.sampling.group_size, w.sampling.max_new_tokens, w.sampling.attend_phases
    R = w.slots
    ids, mask = jnp.asarray(w.ids[:R // G]), jnp.asarray(w.mask[:R // G])
    graphdef, state = nnx.split(w.model)

    @functools.partial(jax.jit, static_argnums=(3,))
    def static_cache(state, ids, mask, c):
        model = nnx.merge(graphdef, state)
        _, cache = model.prefill(ids, mask, group_size=G, decode_steps=M - 1, chunks=phases, last_only=True)
        return noisy(cache.replace(length=jnp.int32(c * cache.chunk_size)))

    @functools.partial(jax.jit, static_argnums=(2,), donate_argnums=(1,))
    def static_steps(state, cache, c):
        model = nnx.merge(graphdef, state)
        weights = model.layer_weights()

        def body(i, carry):
            logits, cache = model.decode_step(carry[0], carry[1], chunk=c, weights=weights)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache
        return jax.lax.fori_loop(0, cache.chunk_size, body, (jnp.zeros((cache.rows,), jnp.int32), cache))

    @jax.jit
    def slot_cache(state, ids, mask, c):
        _, k, v, pm, pp = nnx.merge(graphdef, state).prefill_kv(ids, mask)
        cache = SlotCache.create(k, v, pm, pp, shards=1, slots=R, decode_steps=max(M - 1, 1), phases=phases)
        return noisy(cache.replace(slot_prompt=(jnp.arange(R, dtype=jnp.int32) // G)[None],
                                   slot_t=jnp.full((1, R), c * cache.chunk_size, jnp.int32)))

    @functools.partial(jax.jit, donate_argnums=(1,))
    def slot_steps(state, cache, c):  # c traced, as in the engine (lax.switch per layer)
        model = nnx.merge(graphdef, state)
        weights = model.layer_weights()

        def body(i, carry):
            logits, cache, _ = slot_decode_step(model, carry[0], carry[1], phase=c, weights=weights)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache
        return jax.lax.fori_loop(0, cache.chunk_size, body, (jnp.zeros((1, R), jnp.int32), cache))

    def seconds(make, run, c):
        """The fastest of 3 timed calls of `run` (after a warm-up), each on a fresh cache from `make`."""
        times = []
        for i in range(4):
            cache = jax.block_until_ready(make(state, ids, mask, c))
            t = time.perf_counter()
            jax.block_until_ready(run(state, cache, c))
            times.append(time.perf_counter() - t)
        return min(times[1:])

    C = -(-(M - 1) // phases)
    print(f"{R} rows, {C} steps per phase, prompt bucket {ids.shape[1]}")
    for c in range(phases):
        s = seconds(static_cache, static_steps, c) / C
        t = seconds(slot_cache, slot_steps, jnp.int32(c)) / C
        print(f"phase {c}: static {s * 1e3:.2f} ms/step, continuous {t * 1e3:.2f} ms/step, ratio {t / s:.3f}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
