"""The continuous engine's typed state: how a call's sequences map onto the engine (`EngineLayout`),
what every step reads besides the state (`EngineLoop`), and the loop state itself (`EngineState`,
a pytree the jitted loop carries and the host-driven segments pass between calls).

Shape letters: grpo_jax.shapes (Z row shards, J decode slots per shard, Np prompts per shard,
Rb = Np x G sequences per shard, M max new tokens, V vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.struct
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.config import SamplingConfig
from grpo_jax.engine.slots import SlotCache, slot_decode_step
from grpo_jax.runtime.sharding import BATCH, rows_per_shard


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """How a call's sequences map onto the engine: Z shards of Np prompts, Rb sequences and J slots."""

    shards: int
    prompts: int  # Np, per shard
    sequences: int  # Rb, per shard
    slots: int  # J, per shard


def engine_layout(num_prompts: int, config: SamplingConfig, mesh: Mesh) -> EngineLayout:
    """The layout of `num_prompts` prompts: `config.slots` (0 = one per sequence) split evenly over
    the mesh's row shards, rounded up, and never more per shard than the shard has sequences."""
    Z = rows_per_shard(mesh)
    if num_prompts % Z:
        raise ValueError(f"{num_prompts} prompts do not split over data x fsdp x expert = {Z} row shards")
    Np = num_prompts // Z
    Rb = Np * config.group_size
    J = Rb if config.slots == 0 else min(Rb, -(-config.slots // Z))
    return EngineLayout(shards=Z, prompts=Np, sequences=Rb, slots=J)


@flax.struct.dataclass
class EngineState:
    """The continuous engine's loop state: the slots, the cache, the queues and the outputs so far.
    Every array with a leading Z axis is split over the mesh's row shards (`EngineLoop.hold`)."""

    seq: jax.Array  # int32 [Z, J]: the shard-local sequence each slot decodes, -1 = empty
    cache: SlotCache  # the prompts' keys/values and each slot's generated block (slot_prompt, slot_t [Z, J])
    prompt_logits: jax.Array  # float32 [Z, Np, V]: each prompt's prefill logits (draw a sequence's first token)
    logits: jax.Array  # float32 [Z, J, V]: the logits each slot draws its next token from
    uniforms: jax.Array | None  # float32 [Z, Rb, M]: each sequence's own draws; None at temperature 0
    admitted: jax.Array  # int32 [Z]: sequences of the shard admitted to a slot (the next to admit)
    done: jax.Array  # int32 [Z]: sequences of the shard finished
    tokens: jax.Array  # int32 [Z, Rb, M]: each sequence's tokens (pad_id past its end)
    logprobs: jax.Array  # float32 [Z, Rb, M]: their log-probs (0 past the end)
    lengths: jax.Array  # int32 [Z, Rb]: tokens of each finished sequence (0 until it finishes)
    truncated: jax.Array  # bool [Z, Rb]: the sequence hit max_new_tokens without a stop token
    steps: jax.Array  # int32 []: loop steps run
    useful: jax.Array  # int32 []: slot-steps that drew a sequence's token
    slot_steps: jax.Array  # int32 []: slot-steps run, busy or idle
    # A mixture-of-experts model (engine.routing; None for a dense one): each prompt's prefill
    # experts [Z, Np, P, L, Kx] and each sequence's fed tokens' experts [Z, Rb, M, L, Kx].
    prompt_experts: jax.Array | None = None
    experts: jax.Array | None = None

    @property
    def num_prompts(self) -> int:
        """N: the call's prompts, all shards together."""
        return self.prompt_logits.shape[0] * self.prompt_logits.shape[1]


@dataclasses.dataclass(frozen=True)
class EngineLoop:
    """What every step of a call's loop reads besides the loop state: the layout, the sampling
    settings, the attention phase size, the decode step (with the model's weights) and the mesh."""

    lay: EngineLayout
    config: SamplingConfig
    phase_size: int
    decode: Callable  # (tokens [Z, J], cache, phase=) -> (logits [Z, J, V], cache, experts): slot_decode_step
    mesh: Mesh

    def hold(self, x):
        """Keep an engine array's leading axis (shards, or slots of all shards) split over the
        mesh's row axes, so each shard's bookkeeping stays on its own devices."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(BATCH)))


def engine_loop(model, config: SamplingConfig, mesh: Mesh, lay: EngineLayout, chunk_size: int) -> EngineLoop:
    """The loop's constants for `model` (its decode step, with the weights hoisted); `chunk_size`:
    the cache's generated slots per attention phase (`SlotCache.chunk_size`)."""
    decode = functools.partial(slot_decode_step, model, weights=model.layer_weights(), mesh=mesh)
    return EngineLoop(lay=lay, config=config, phase_size=chunk_size, decode=decode, mesh=mesh)


def resume_loop(model, config: SamplingConfig, mesh: Mesh, st: EngineState) -> EngineLoop:
    """The loop's constants for a state started earlier (`continuous.start_engine`), for a segment
    of the loop run in its own call."""
    lay = engine_layout(st.num_prompts, config, mesh)
    return engine_loop(model, config, mesh, lay, st.cache.chunk_size)
