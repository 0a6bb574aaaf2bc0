"""How a call's sequences map onto the paged engine's row shards and slots (`EngineLayout`).

Shape letters: grpo_jax.shapes (Z row shards, J decode slots per shard, Np prompts per shard,
Rb = Np x G sequences per shard).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from grpo_jax.config import SamplingConfig
from grpo_jax.runtime.sharding import rows_per_shard


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
