"""One decode step of each rollout engine at equal rows and attended length (issue 27): the static
engine's `Transformer.decode_step` in chunk c against the continuous engine's `slot_decode_step` in
phase c (slots = rows, slot j decoding from prompt j // G, every slot at the same step), C steps
inside one jit each, minus a prefill-only call; the minimum of 3 calls after a warm-up.

    python benchmarks/engine_step_cost.py benchmarks/configs/peers.yaml sampling.slots=64

Arguments: a run config and `--set`-style overrides; rows = sampling.slots.
"""

import functools
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.slots import SlotCache, slot_decode_step
from grpo_jax.tools.bench.engine_runs import load_workload


def main(config_path, overrides):
    w = load_workload(config_path, overrides)
    G, M, phases = w.sampling.group_size, w.sampling.max_new_tokens, w.sampling.attend_phases
    R = w.slots
    ids, mask = jnp.asarray(w.ids[:R // G]), jnp.asarray(w.mask[:R // G])
    graphdef, state = nnx.split(w.model)

    @functools.partial(jax.jit, static_argnums=(3,))
    def static_steps(state, ids, mask, c):
        model = nnx.merge(graphdef, state)
        _, cache = model.prefill(ids, mask, group_size=G, decode_steps=M - 1, chunks=phases, last_only=True)
        cache, weights = cache.replace(length=jnp.int32(c * cache.chunk_size)), model.layer_weights()

        def body(i, carry):
            logits, cache = model.decode_step(carry[0], carry[1], chunk=c, weights=weights)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache
        return jax.lax.fori_loop(0, cache.chunk_size, body, (jnp.zeros((cache.rows,), jnp.int32), cache))[0]

    @jax.jit
    def slot_steps(state, ids, mask, c):  # c traced, as in the engine (lax.switch per layer)
        model = nnx.merge(graphdef, state)
        _, k, v, pm, pp = model.prefill_kv(ids, mask)
        cache = SlotCache.create(k, v, pm, pp, shards=1, slots=R, decode_steps=max(M - 1, 1), phases=phases)
        C = cache.chunk_size
        cache = cache.replace(slot_prompt=(jnp.arange(R, dtype=jnp.int32) // G)[None],
                              slot_t=jnp.full((1, R), c * C, jnp.int32))
        weights = model.layer_weights()

        def body(i, carry):
            logits, cache = slot_decode_step(model, carry[0], carry[1], phase=c, weights=weights)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache
        return jax.lax.fori_loop(0, C, body, (jnp.zeros((1, R), jnp.int32), cache))[0]

    prefill = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state).prefill_kv(ids, mask)[0])

    def seconds(fn, *args):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
        return min(times)

    base, C = seconds(prefill, state, ids, mask), -(-(M - 1) // phases)
    print(f"{R} rows, {C} steps per phase, prompt bucket {ids.shape[1]}")
    for c in range(phases):
        s = (seconds(static_steps, state, ids, mask, c) - base) / C
        t = (seconds(slot_steps, state, ids, mask, jnp.int32(c)) - base) / C
        print(f"phase {c}: static {s * 1e3:.2f} ms/step, continuous {t * 1e3:.2f} ms/step, ratio {t / s:.3f}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
