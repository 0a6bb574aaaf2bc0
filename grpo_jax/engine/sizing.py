"""`sampling.kv_cache_bytes: auto`: the paged engine's page pool sized from the chip.

    pool = kv_cache_fraction x (chip memory - what the run holds on it while sampling
                                - the sampler's own buffers besides the pool)

per row shard (a row shard's chips each hold its whole pool: pages are split over the mesh's
batch axes only). What the run holds (`held`): the train state (parameters, optimizer moments),
a LoRA run's frozen base, the KL reference's copy, a teacher, per chip by their shardings
(`trainer.setup.held_bytes`: the run's own construction on abstract shapes). The sampler's
buffers (`sampler_bytes`): the weights cast to the compute dtype when it differs from the
parameters', the prefill's keys and values and activations, the logits and the per-sequence
outputs. `kv_cache_fraction` (default 0.9, vLLM's `gpu_memory_utilization` convention applied to
what is left) keeps a margin for what the estimate misses; `grpo-jax plan` and `bench memory`
check the result with the compiler.

On CPU there is no device memory to size from: `auto` resolves to 0 (one max-length reservation
per slot, today's behaviour) unless a chip's memory is given. With the pool sized, `slots: 0`
becomes as many slots as the pool holds sequences at half their max length (at most one per
sequence): what the pool keeps busy; a longer `max_new_tokens` then costs time (fewer sequences
at once, preemption), never an out-of-memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from grpo_jax.engine.pages import page_bytes, pages_needed

GIB = 2**30

# HBM per chip by JAX's device_kind, where a device reports no memory (compile-only topologies).
CHIP_BYTES = {"TPU v5 lite": 16 * GIB, "TPU v5e": 16 * GIB, "TPU v6 lite": 32 * GIB, "TPU v6e": 32 * GIB,
              "TPU v5p": 95 * GIB, "TPU v5": 95 * GIB, "TPU v4": 32 * GIB}


def chip_bytes(mesh) -> int | None:
    """One chip's memory on `mesh` (the smallest `bytes_limit` its devices report, else its TPU
    kind's HBM), or None on CPU."""
    devices = list(mesh.devices.flat)
    if devices[0].platform == "cpu":
        return None
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # compile-only devices have no runtime to ask
            stats = {}
        limits.append(stats.get("bytes_limit"))
    if all(limits):
        return int(min(limits))
    return CHIP_BYTES.get(devices[0].device_kind)


@dataclasses.dataclass(frozen=True)
class CacheSizing:
    """How `auto` was resolved, per chip (bytes): the chip, what the run holds, the sampler's
    other buffers, the pool and the slots it keeps busy."""

    chip: int
    held: int
    sampler: int
    fraction: float
    pool: int
    slots: int

    def line(self) -> str:
        g = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
        return (f"sampling.kv_cache_bytes: auto -> {self.pool:,} bytes ({g(self.pool)}) per row shard = "
                f"{self.fraction} x ({g(self.chip)} chip - {g(self.held)} held by the run - {g(self.sampler)} of the "
                f"sampler's other buffers); slots {self.slots}")


def pool_bytes(*, chip: int, held: int, sampler: int, fraction: float) -> int:
    """The formula: fraction x (chip - held - sampler), at least 0."""
    return max(0, int(fraction * (chip - held - sampler)))


def sampler_bytes(model_config, *, dtype, param_dtype, params_per_chip: int, prompts: int, prompt_slots: int,
                  sequences: int, slots: int, max_new_tokens: int) -> int:
    """The sampler's buffers besides the page pool, per row shard: the weights cast to `dtype`
    (when the parameters are another dtype), the prefill of `prompts` prompts of `prompt_slots`
    (its keys and values, its widest activation, its last logits), and the decode loop's logits of
    `slots` slots (three copies: logits, probabilities, their sort) and `sequences` sequences'
    outputs (tokens, log-probs, uniforms)."""
    m = model_config
    size, psize = jnp.dtype(dtype).itemsize, jnp.dtype(param_dtype).itemsize
    weights = params_per_chip * size // psize if size != psize else 0
    prefill_kv = m.num_layers * 2 * prompts * m.num_kv_heads * prompt_slots * m.head_dim * size
    widest = max(m.hidden_size, m.intermediate_size, m.num_heads * m.head_dim, getattr(m, "moe_intermediate_size", 0)
                 * max(getattr(m, "num_experts_per_tok", 1), 1))
    activations = 4 * prompts * prompt_slots * widest * size
    logits = (prompts + 3 * slots) * m.vocab_size * 4
    outputs = 3 * sequences * max_new_tokens * 4
    return weights + prefill_kv + activations + logits + outputs


def busy_slots(model_config, dtype, sampling, *, pool: int, prompts: int, prompt_slots: int, sequences: int) -> int:
    """Slots per row shard the pool keeps busy: the sequences it holds at half their max length
    beside the prompt region, at least 1, at most `sequences`."""
    each = page_bytes(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, sampling.page_size,
                      jnp.dtype(dtype).itemsize)
    Tp, _ = pages_needed(prompt_slots, sampling.max_new_tokens, sampling.page_size)
    free = pool // each - 1 - prompts * Tp
    half = -(-(sampling.max_new_tokens // 2) // sampling.page_size) + 1
    return int(min(sequences, max(1, free // half)))


def per_chip(tree) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs carrying shardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def resolve_kv_cache(config, model_config, mesh, sampling, *, held: Callable[[], tuple[int, int]],
                     chip: int | None = None) -> tuple[object, CacheSizing | None]:
    """`sampling` (a SamplingConfig of `config`'s run) with `kv_cache_bytes: auto` resolved for
    `mesh` -> (the settings, how they were sized, or None where nothing was sized). `held()`: (bytes
    the run holds per chip while sampling, of which trainable parameters), asked only when a chip
    is sized (grpo_jax.trainer.setup.held_bytes); `chip`: one chip's memory (default
    `chip_bytes(mesh)`, None on CPU: auto -> 0)."""
    from grpo_jax.config import ConfigError
    from grpo_jax.config.rollout import ENGINE_TRAITS
    from grpo_jax.runtime.sharding import rows_per_shard

    if sampling.kv_cache_bytes != "auto":
        return sampling, None
    chip = chip_bytes(mesh) if chip is None else chip
    if chip is None or not ENGINE_TRAITS[sampling.engine][1]:
        return dataclasses.replace(sampling, kv_cache_bytes=0), None
    total, params = held()
    Z = rows_per_shard(mesh)
    P = max(sampling.prompt_buckets)

    def slots_for(rows: int) -> int:  # per row shard: one per row, or the configured slots
        return rows if sampling.slots == 0 else min(rows, -(-sampling.slots // Z))

    def other_of(prompts_per_call: int, group_size: int) -> int:
        prompts = -(-prompts_per_call // Z)
        rows = prompts * group_size
        return sampler_bytes(model_config, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                             params_per_chip=params, prompts=prompts, prompt_slots=P, sequences=rows, slots=slots_for(rows),
                             max_new_tokens=sampling.max_new_tokens)

    # The step's sampler and evaluation's (calls of at most 64 prompts, rollout.evaluation.prompts_per_call)
    # share the pool's size: the larger of their other buffers is left out of it.
    other = max(other_of(config.data.prompts_per_step, sampling.group_size),
                other_of(min(64, config.eval.num_prompts), config.eval.k))
    prompts = -(-config.data.prompts_per_step // Z)
    sequences = prompts * sampling.group_size
    slots = slots_for(sequences)
    pool = pool_bytes(chip=chip, held=total, sampler=other, fraction=sampling.kv_cache_fraction)
    each = page_bytes(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, sampling.page_size,
                      jnp.dtype(config.model.dtype).itemsize)
    Tp, most = pages_needed(P, sampling.max_new_tokens, sampling.page_size)
    if pool // each < 1 + prompts * Tp + most:
        g = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
        raise ConfigError(
            f"sampling.kv_cache_bytes: auto leaves {g(pool)} per chip for the KV cache ({g(chip)} chip, {g(total)} held "
            f"by the run, {g(other)} of the sampler's other buffers), less than the prompts and one sequence of "
            f"max_new_tokens={sampling.max_new_tokens} need ({g((1 + prompts * Tp + most) * each)}): shard the model "
            "over more chips (mesh.fsdp), lower data.prompts_per_step or the lengths")
    if sampling.slots == 0:
        slots = busy_slots(model_config, config.model.dtype, sampling, pool=pool, prompts=prompts, prompt_slots=P,
                           sequences=sequences)
    sized = CacheSizing(chip=chip, held=total, sampler=other, fraction=sampling.kv_cache_fraction, pool=pool,
                        slots=slots * Z)
    return dataclasses.replace(sampling, kv_cache_bytes=pool, slots=slots * Z), sized
