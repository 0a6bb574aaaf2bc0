"""The pmap mode (`parallelism: pmap`): pure data parallelism on one host, isolated here. The train
state is replicated on every local device and the same step (`train_step.bind_train_step`) runs
under `jax.pmap`, the batch's rows split across devices; `Devices` is how its programs' rows make
the whole batch (gathered for the loss's normaliser and metrics, gradients and sums added), the
only thing the step knows of the mode. Sampling runs on a data-only mesh over the same devices.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from grpo_jax.learner.across import Across
from grpo_jax.learner.learner import Learner
from grpo_jax.learner.train_step import bind_train_step
from grpo_jax.runtime.sharding import replicate, replicated, split_rows, unreplicate

AXIS = "devices"


class Devices(Across):
    """The programs of one `jax.pmap` over `axis_name`, each holding a slice of the batch's rows."""

    whole = False

    def __init__(self, axis_name: str = AXIS):
        self.axis_name = axis_name

    def gather(self, x: jax.Array) -> jax.Array:
        return jax.lax.all_gather(x, self.axis_name, tiled=True)

    def sum(self, tree):
        return jax.lax.psum(tree, self.axis_name)

    def max(self, tree):
        return jax.lax.pmax(tree, self.axis_name)

    def count(self) -> int:
        return jax.lax.psum(1, self.axis_name)

    def index(self) -> jax.Array:
        return jax.lax.axis_index(self.axis_name)


def pmap_step(spec, devices):
    """`step(state [replicated], rows [split]) -> (state, metrics [per device])`: the train step pmapped."""
    return jax.pmap(bind_train_step(dataclasses.replace(spec, across=Devices())), axis_name=AXIS,
                    donate_argnums=(0,), devices=devices)


class PmapLearner(Learner):
    """pmap over the local devices: the state replicated, the batch's rows split, gradients summed."""

    def __init__(self, config, mesh, graphdef, optimizer, state, **kwargs):
        super().__init__(config, mesh, graphdef, optimizer, state, **kwargs)
        self.devices = jax.local_devices()
        self._step = pmap_step(self.spec, self.devices)

    def place(self, state):
        return replicate(state, self.devices)

    def step(self, state, batch):
        rows = split_rows(jax.tree.map(np.asarray, batch), len(self.devices))
        state, out = self._step(state, rows)
        return state, unreplicate(out)

    def _pack_layout(self):
        return dict(shards=len(self.devices), local_bins=True, place=None)

    def params(self, state):
        return jax.device_put(unreplicate(state.params), replicated(self.mesh))

    def unplace(self, state):
        return unreplicate(state)
