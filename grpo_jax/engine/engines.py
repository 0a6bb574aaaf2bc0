"""The decode engines, chosen once by `sampling.engine` (`engine_of`): what each is (`Engine`'s
traits) and its program. The rest of the package asks the engine object, never its name.

- `static`: the lock-step loop over every row at once, max-length cache (grpo_jax.engine.lockstep);
  the reference the others are tested against.
- `continuous`: `sampling.slots` rows decode at once, refilled on device as rows finish
  (grpo_jax.engine.continuous).
- `paged`: slots over a page pool that preempts when full (grpo_jax.engine.paged).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.sharding import Mesh

from grpo_jax.config import SamplingConfig
from grpo_jax.config.rollout import ENGINE_TRAITS
from grpo_jax.engine.continuous import continuous_program, start_engine
from grpo_jax.engine.lockstep import static_program
from grpo_jax.engine.paged import paged_program, start_paged


@dataclasses.dataclass(frozen=True)
class Engine:
    """A decode engine. `slots`: it decodes `sampling.slots` rows at once, admitting new ones as rows
    finish (so a run can over-sample in one pass: `start`); `pages`: its cache is a page pool
    (`sampling.kv_cache_bytes`, `page_size`, `paged_attention`) that preempts when full."""

    name: str
    slots: bool
    pages: bool
    # (graphdef, config, mesh, share_prefill) -> the jitted program (each maker caches its programs).
    _program: Callable = dataclasses.field(repr=False)
    # (model, ids [N, P], mask [N, P], key, *, config, mesh) -> (loop, state): the streaming loop's start.
    start: Callable | None = dataclasses.field(default=None, repr=False)

    def program(self, graphdef, config: SamplingConfig, mesh: Mesh, *, share_prefill: bool = True):
        """The jitted engine: `(model state, ids [N, P], mask [N, P], key) -> (Rollout, stats)`, rows
        split over the mesh's (data, fsdp, expert); its `.lower` on abstract shapes shows its memory
        (`grpo-jax bench memory`). `share_prefill=False`: the static engine's reference path (the
        engines with slots always prefill each prompt once)."""
        return self._program(graphdef, config, mesh, share_prefill)


ENGINES = {
    "static": Engine("static", *ENGINE_TRAITS["static"],
                     _program=lambda graphdef, config, mesh, share: static_program(graphdef, config, share, mesh)),
    "continuous": Engine("continuous", *ENGINE_TRAITS["continuous"], start=start_engine,
                         _program=lambda graphdef, config, mesh, share: continuous_program(graphdef, config, mesh)),
    "paged": Engine("paged", *ENGINE_TRAITS["paged"], start=start_paged,
                    _program=lambda graphdef, config, mesh, share: paged_program(graphdef, config, mesh))}


def engine_of(config: SamplingConfig) -> Engine:
    """The engine `config.engine` names."""
    return ENGINES[config.engine]
