"""A pipelined rollout source: exact, bounded staleness, and the sampler on its own devices
(`rollout.staleness`, `rollout.sampler_devices`; grpo_jax.config.RolloutConfig).

With staleness k the batch of step t is sampled with the parameters after step t - 1 - k: the
source keeps up to k finished batches ahead of the learner. The loop asks for step t's batch
(`next`), the learner dispatches its update and, while its programs run, asks the source for the
batch of step t + k (`ahead`, sampled with the parameters the sampler holds: those after step
t - 1); then the new parameters come back (`sync`). One thread dispatches everything in that order
on every host, so the programs of the two meshes interleave the same way everywhere (multi-
controller collectives cannot deadlock), and JAX's asynchronous dispatch lets the sampler's
programs run beside the learner's on disjoint devices. The first batches (steps 1 .. k+1) are all
sampled with the starting parameters: their staleness is t - 1 (`rollout/staleness` says so).

A checkpoint of step s holds what the batches in flight (steps s+1 .. s+k) need to be sampled
again exactly: the parameters each was sampled with, and the prompt stream's and the rewards'
states from before the first of them (`checkpoint`); a resumed run samples them again with those
parameters (`restore`) and then goes on as the uninterrupted run did.

With LoRA only the adapters move after each update (`perf/weight_sync_bytes`); the frozen base
goes to the sampler's devices once, and there the adapters are merged into it (W + (alpha / r) A B,
jitted): the sampler runs a plain model, without the adapters' extra matmuls.

The sampler's parameters are its own copy: on its own mesh (`runtime.transfer.copy_to`, device
to device, timed as `perf/weight_sync_s`), or with staleness on the learner's devices a copy there
(the learner donates its buffers to each update while the sampler still reads the older ones).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.lora import LoRAParam, has_adapters, merge_adapters, strip_adapters
from grpo_jax.learner.feed import Stateful
from grpo_jax.rollout.source import InFlight, RolloutSource, Trajectories
from grpo_jax.runtime.sharding import param_shardings
from grpo_jax.runtime.transfer import copy_to


class PipelinedSource(RolloutSource):
    """`inner`: a SyncSampler whose model the sampler reads (on `sampler_mesh` when given, which
    `inner` samples on); `staleness`: k; `last_step`: the run's last step (no batch is sampled
    beyond it)."""

    def __init__(self, inner, *, staleness: int, last_step: int, sampler_mesh=None):
        self.inner, self.k, self.sampler_mesh, self.last_step = inner, staleness, sampler_mesh, last_step
        self.queue: dict[int, Trajectories] = {}
        self.made_with: dict[int, int] = {}  # step -> the step whose parameters sampled its batch
        self.to_make: int | None = None  # the next step whose batch is to be sampled
        self.params_step: int | None = None  # the step whose parameters the sampler holds
        self.sync_s = 0.0
        self.params_of: dict[int, nnx.State] = {}  # step -> the parameters its batch was sampled with
        self.rewind: dict[int, dict] = {}  # step -> stream and reward states before its batch was sampled
        self.restored: list[tuple[int, nnx.State]] = []  # a resumed run's batches to sample again first
        # The sampler's own module: the learner's state (a LoRA run's frozen base among it) may
        # hold the Variables of the model it was built from, which the sampler's updates must not move.
        held = nnx.clone(inner.model)
        # What the learner trains and sends: every parameter, or with LoRA only the adapters (the
        # frozen base goes to the sampler's devices once, here).
        lora = has_adapters(held)
        self.trainable = LoRAParam if lora else nnx.Param
        self.shardings = None
        self.sync_bytes = 0
        if sampler_mesh is not None:
            whole = nnx.state(held, nnx.Param)
            nnx.update(held, copy_to(whole, param_shardings(whole, sampler_mesh).shardings))
            self.shardings = param_shardings(nnx.state(held, self.trainable), sampler_mesh).shardings
        # With LoRA the pipeline holds the adapted model and the sampler a plain one whose weights
        # are the adapters merged into the base, W + (alpha / r) A B, after every update.
        self.adapted = held if lora else None
        inner.use_model(strip_adapters(held) if lora else held)
        if lora:
            graphdef = nnx.graphdef(held)
            self._merge = jax.jit(lambda state: nnx.state(merge_adapters(nnx.merge(graphdef, state)), nnx.Param))
            self._load(nnx.state(held, LoRAParam))

    @property
    def model(self):
        return self.inner.model

    def _held(self):
        """The module whose trainable parameters the learner's updates replace."""
        return self.adapted if self.adapted is not None else self.inner.model

    def _load(self, params: nnx.State) -> None:
        """The sampler takes `params` (the learner's trainable parameters, on its devices)."""
        if self.adapted is None:
            self.inner.sync(params)
            return
        nnx.update(self.adapted, params)
        nnx.update(self.inner.model, self._merge(nnx.state(self.adapted)))

    def next(self, step: int) -> Trajectories:
        if self.to_make is None:  # the run's first step (or its first after a resume)
            self.to_make, self.params_step = step, step - 1
            self._make_restored()
            while self.to_make < min(step + self.k, self.last_step + 1):
                self._make()
        if step not in self.queue:  # staleness 0: sampled now, with the latest parameters
            self._make()
        t = self.queue.pop(step)
        self.params_of.pop(step, None)
        self.rewind.pop(step, None)
        t.metrics.update({"rollout/staleness": float(step - 1 - self.made_with.pop(step)),
                          "perf/weight_sync_s": self.sync_s, "perf/weight_sync_bytes": float(self.sync_bytes)})
        return t

    def ahead(self) -> None:
        """While the learner updates on step t's batch: sample the batch of step t + k."""
        if self.k and self.to_make is not None and self.to_make <= self.last_step:
            self._make()

    def _make(self, params_step: int | None = None) -> None:
        step = self.to_make
        # The checkpoint's components as they were before this batch: a checkpoint taken with it in flight
        # saves these instead, and a resumed run samples it again.
        self.rewind[step] = {name: c.state_dict() for name, c in self.inner.components().items()}
        self.params_of[step] = self._params()
        self.queue[step] = self.inner.next(step)
        self.made_with[step] = self.params_step if params_step is None else params_step
        self.to_make += 1

    def _make_restored(self) -> None:
        """A resumed run's batches in flight, sampled again with the parameters they had."""
        if not self.restored:
            return
        current = self._params()
        for params_step, params in self.restored:
            self._load(params)
            self._make(params_step)
        self._load(current)
        self.restored = []

    def _params(self) -> nnx.State:
        """The sampler's parameters now: a snapshot (nnx.state's Variables follow later updates of
        the model; the arrays themselves never change)."""
        return jax.tree.map(lambda x: x, nnx.state(self._held(), self.trainable))

    def in_flight(self) -> InFlight | None:
        """The batches sampled and not yet learned from, with their parameters and the stream and
        reward states to rewind to, for a checkpoint taken now; None when nothing is in flight."""
        steps = sorted(self.queue)
        if not steps:
            return None
        meta = {"steps": steps, "made_with": [self.made_with[u] for u in steps]}
        return InFlight(meta=meta, params=[self.params_of[u] for u in steps], rewind=self.rewind[steps[0]])

    def in_flight_like(self, count: int) -> list:
        """Shapes and shardings of `count` parameter copies as the sampler holds them (to restore)."""
        params = nnx.state(self._held(), self.trainable)
        shardings = self.shardings if self.shardings is not None else jax.tree.map(lambda x: x.sharding, params)
        like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
        return [like] * count

    def restore(self, meta: dict, params: list) -> None:
        """A checkpoint's batches in flight (`in_flight`), sampled again at the first `next`."""
        self.restored = list(zip(meta["made_with"], params))

    def sync(self, params: nnx.State) -> None:
        t0 = time.perf_counter()
        if self.sampler_mesh is not None:
            params = copy_to(params, self.shardings, into=nnx.state(self._held(), self.trainable))
        elif self.k:
            params = jax.tree.map(jnp.copy, params)
        self._load(jax.block_until_ready(params))
        jax.block_until_ready(nnx.state(self.inner.model))
        self.sync_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        self.sync_s = time.perf_counter() - t0
        if self.params_step is not None:
            self.params_step += 1

    def components(self) -> dict[str, Stateful]:
        return self.inner.components()
