"""The decode engines, chosen once by `sampling.engine` (`engine_of`): what each is (`Engine`'s
traits) and its program. The rest of the package asks the engine object, never its name.

- `static`: the lock-step loop over every row at once, max-length cache (grpo_jax.engine.lockstep);
  the reference the others are tested against.
- `paged` (the production engine, grpo_jax.engine.paged): `sampling.slots` rows decode at once,
  refilled on device as rows finish, over a page pool that preempts when full
  (`sampling.kv_cache_bytes`), or with 0 bytes on the gather path (not JAX's TPU kernel) one
  max-length reservation per slot read in place;
  the lock-step loop inside it when every sequence has a slot and the bytes hold them all.
- `continuous`: the paged engine with one max-length reservation per slot, whatever
  `kv_cache_bytes` says (the per-slot engine of earlier releases, folded into the paged one; its
  configs run unchanged).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.sharding import Mesh

from grpo_jax.config import SamplingConfig
from grpo_jax.config.rollout import ENGINE_TRAITS
from grpo_jax.engine.lockstep import static_program
from grpo_jax.engine.paged import paged_program, start_paged


@dataclasses.dataclass(frozen=True)
class Engine:
    """A decode engine. `slots`: it decodes `sampling.slots` rows at once, admitting new ones as rows
    finish (so a run can over-sample in one pass: `start`); `pages`: its cache can be a page pool
    (`sampling.kv_cache_bytes`, `page_size`, `paged_attention`) that preempts when full; `fixed`:
    the sampling settings the engine sets whatever the config says (`settings`)."""

    name: str
    slots: bool
    pages: bool
    # (graphdef, config, mesh, share_prefill) -> the jitted program (each maker caches its programs).
    _program: Callable = dataclasses.field(repr=False)
    # (model, ids [N, P], mask [N, P], key, *, config, mesh) -> (loop, state): the streaming loop's start.
    _start: Callable | None = dataclasses.field(default=None, repr=False)
    fixed: tuple[tuple[str, object], ...] = ()

    def settings(self, config: SamplingConfig) -> SamplingConfig:
        """`config` as this engine runs it (its `fixed` settings over the config's)."""
        return dataclasses.replace(config, **dict(self.fixed)) if self.fixed else config

    def program(self, graphdef, config: SamplingConfig, mesh: Mesh, *, share_prefill: bool = True):
        """The jitted engine: `(model state, ids [N, P], mask [N, P], key) -> (Rollout, stats)`, rows
        split over the mesh's (data, fsdp, expert); its `.lower` on abstract shapes shows its memory
        (`grpo-jax bench memory`). `share_prefill=False`: the static engine's reference path (the
        engines with slots always prefill each prompt once)."""
        return self._program(graphdef, self.settings(config), mesh, share_prefill)

    def start(self, model, ids, mask, key, *, config: SamplingConfig, mesh: Mesh):
        """The streaming loop's start (an engine with slots): `(loop constants, loop state)`."""
        if self._start is None:
            raise ValueError(f"the {self.name} engine decodes every row at once and has no streaming loop to start "
                             "(sampling.engine: paged or continuous has one)")
        return self._start(model, ids, mask, key, config=self.settings(config), mesh=mesh)


PAGED = dict(_program=lambda graphdef, config, mesh, share: paged_program(graphdef, config, mesh), _start=start_paged)
ENGINES = {
    "static": Engine("static", *ENGINE_TRAITS["static"],
                     _program=lambda graphdef, config, mesh, share: static_program(graphdef, config, share, mesh)),
    "paged": Engine("paged", *ENGINE_TRAITS["paged"], **PAGED),
    # One max-length reservation per slot, read in place (engine.layouts.SlotPages).
    "continuous": Engine("continuous", *ENGINE_TRAITS["continuous"], **PAGED,
                         fixed=(("kv_cache_bytes", 0), ("paged_attention", "gather")))}


def engine_of(config: SamplingConfig) -> Engine:
    """The engine `config.engine` names."""
    return ENGINES[config.engine]
