"""The run's parallelism, chosen once from the config: the one place that asks which mode a run is in."""

from __future__ import annotations

import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.config import RunConfig
from grpo_jax.learner.learner import Learner, MeshLearner
from grpo_jax.learner.pmap import PmapLearner
from grpo_jax.learner.step_factory import TrainState

LEARNERS = {"jit": MeshLearner, "pmap": PmapLearner}  # `parallelism` -> its learner


def make_learner(config: RunConfig, mesh: Mesh, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                 state: TrainState, **kwargs) -> Learner:
    """The run's learner for its `config.parallelism`, over `mesh` (grpo_jax.runtime.devices.run_mesh),
    for the initial train state `state`; the keywords as `Learner`'s."""
    return LEARNERS[config.parallelism](config, mesh, graphdef, optimizer, state, **kwargs)
