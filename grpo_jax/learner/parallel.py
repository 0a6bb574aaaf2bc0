"""How a run spreads over its devices, chosen once from the config (`make_parallel`), the only
place that asks which mode a run is in.

- `parallelism: jit` (`MeshParallel`): one (data, fsdp, expert, tensor) mesh for sampling and training;
  the train state is placed by the logical-axis rules (grpo_jax.runtime.sharding) and the train
  step is jitted with explicit in/out shardings.
- `parallelism: pmap` (`PmapParallel`): pure data parallelism on one host; the train state is
  replicated on every local device and the same `train_step` runs under `jax.pmap` with the batch's
  rows split across devices. Sampling runs on a data-only mesh over the same devices.

Either way a batch enters `step` as global arrays on `mesh` (rows split over data x fsdp x expert), the
steps that complete a batch (`advantages`, `ref_logprobs`) run jitted on that mesh, and every step
and sharding is built when the object is (from the run's initial state), none on first use.
`place` puts a train state where `step` wants it, `unplace` gives one copy back (for
checkpoints), `sampler_params` the policy the sampler reads.
"""

from __future__ import annotations

import abc
import functools

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.config import RunConfig
from grpo_jax.learner.grpo import GroupAdvantages
from grpo_jax.learner.packing import pack_batch, plan_packing
from grpo_jax.learner.step_factory import TrainState
from grpo_jax.learner.train_step import (Batch, bind_train_step, make_advantages_step, make_ref_logprobs_step,
                                         make_train_step)
from grpo_jax.models.layers import parents_supported
from grpo_jax.runtime.sharding import (batch_sharding, param_shardings, replicate, replicated, rows_per_shard,
                                       split_rows, train_state_shardings, tree_shardings, unreplicate)


class Parallel(abc.ABC):
    """What both modes share: the mesh, the advantage and reference log-prob steps on it."""

    def __init__(self, config: RunConfig, mesh: Mesh, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                 state: TrainState, *, temperature: float, frozen: nnx.State | None = None,
                 ref_graphdef: nnx.GraphDef | None = None, critic_graphdef: nnx.GraphDef | None = None,
                 teacher: nnx.Module | None = None):
        """`state`: the run's initial train state (its structure and the params' logical axes fix
        every sharding); `frozen`: the parameters that do not train (a LoRA run's base, placed
        with the model), else None; `ref_graphdef`: the KL reference's structure (a LoRA run's base
        without its adapters: no adapter matmuls, no copy of the weights), else the policy's;
        `critic_graphdef`: a separate critic model's structure (`ppo.critic: model`); `teacher`:
        on-policy distillation's teacher, placed on `mesh`."""
        self.mesh, self.frozen = mesh, frozen
        t = config.train
        self.step_kw = dict(micro_batches=t.micro_batches, logprob_chunk=t.logprob_chunk, temperature=temperature,
                            # rows that share one prompt pass
                            group_size=config.sampling.group_size if t.shared_prompt else 1,
                            ppo_config=config.ppo if config.algorithm == "ppo" else None, seed=t.seed,
                            distill_config=config.distill if config.algorithm == "distill" else None,
                            critic_graphdef=critic_graphdef, moe_config=config.moe)
        self.teacher, self._teacher, self._teacher_graphdef = None, None, None
        if teacher is not None:
            self._teacher_graphdef, self.teacher = nnx.split(teacher, nnx.Param)
            self._teacher = self.teacher_scorer(group_size=self.step_kw["group_size"], temperature=temperature)
        self.packing = None
        if t.packing:
            if jax.process_count() > 1:
                raise ValueError("train.packing plans its bins from the whole batch on one host; with "
                                 f"{jax.process_count()} processes set train.packing: false (not supported yet)")
            self.packing = dict(length=config.pack_length, micro_batches=t.micro_batches,
                                unit=self.step_kw["group_size"], group_size=config.sampling.group_size,
                                shared=t.shared_prompt and parents_supported(config.model.attention, mesh))
        self._advantages = make_advantages_step(config.sampling.group_size, config.grpo, mesh=mesh)
        self._ref = None
        if config.grpo.beta > 0:
            # The reference is a LoRA run's frozen base (placed with the model) or a copy of the
            # policy's params (placed by the rules, like the state's).
            shardings = tree_shardings(frozen) if frozen is not None else param_shardings(state.params, mesh).shardings
            self._ref = make_ref_logprobs_step(graphdef if ref_graphdef is None else ref_graphdef, mesh=mesh,
                                               params_shardings=shardings, logprob_chunk=t.logprob_chunk,
                                               temperature=temperature, group_size=self.step_kw["group_size"],
                                               micro_batches=t.micro_batches,
                                               replay=config.moe.routing_replay == "sampler")
        self.not_sharded: list[str] = []  # parameter dimensions their mesh axis could not split

    def advantages(self, rewards: jax.Array) -> GroupAdvantages:
        """Group normalisation of the global rewards array [R], on the mesh."""
        return self._advantages(rewards)

    def ref_logprobs(self, params: nnx.State, batch: Batch) -> jax.Array:
        """The reference policy's log-probs [R, M] of the batch's completions, on the mesh (over its
        bins when the batch is packed)."""
        return self._ref_step()(params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.packing,
                                _experts(batch))

    def pack(self, batch: Batch) -> tuple[Batch, float | None]:
        """`batch` with its packing plan when the run packs (train.packing), made on the host from
        its masks -> (batch, the bins' fill: the share of their tokens that are real; None unpacked)."""
        if self.packing is None:
            return batch, None
        return pack_batch(batch, **self.packing, **self._pack_layout())

    def plan(self, prompt_len, completion_len):
        """The packing plan (`packing.Plan`, host arrays) of rows of these lengths, laid out as this
        run's step splits them (`grpo-jax bench memory` plans its largest step with it)."""
        layout = {k: v for k, v in self._pack_layout().items() if k != "place"}
        return plan_packing(prompt_len, completion_len, **self.packing, **layout)

    @abc.abstractmethod
    def _pack_layout(self) -> dict:
        """How the step's rows split into shards for `plan_packing` (`shards`, `local_bins`, `place`)."""

    def teacher_scorer(self, *, group_size: int, temperature: float):
        """`score(prompt_ids [R, P], prompt_mask [R, P], completion_ids [R, M]) -> the teacher's
        log-probs [R, M]` at `temperature`, rows in groups of `group_size` sharing a prompt pass
        (the training batch's, or held-out evaluation's k); None without a teacher."""
        if self.teacher is None:
            return None
        step = make_ref_logprobs_step(self._teacher_graphdef, mesh=self.mesh, params_shardings=tree_shardings(
            self.teacher), logprob_chunk=self.step_kw["logprob_chunk"], temperature=temperature, group_size=group_size,
            micro_batches=self.step_kw["micro_batches"])
        score = functools.partial(step, self.teacher)
        score.lower = functools.partial(step.lower, self.teacher)  # `grpo-jax bench memory`
        return score

    def teacher_logprobs(self, batch: Batch) -> jax.Array:
        """The distillation teacher's log-probs [R, M] of the batch's completions, on the mesh."""
        if self._teacher is None:
            raise ValueError("teacher log-probs are computed only with algorithm: distill")
        return self._teacher(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.packing)

    def lower_teacher_logprobs(self, batch: Batch) -> jax.stages.Lowered:
        """`teacher_logprobs`'s program lowered for these arguments (as `lower_ref_logprobs`)."""
        return self._teacher.lower(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.packing)

    def lower_ref_logprobs(self, params, batch: Batch) -> jax.stages.Lowered:
        """`ref_logprobs`'s program lowered for these arguments (arrays or jax.ShapeDtypeStructs):
        `.compile().memory_analysis()` says what it needs before anything is placed."""
        return self._ref_step().lower(params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                      batch.packing, _experts(batch))

    def _ref_step(self):
        if self._ref is None:
            raise ValueError("reference log-probs are computed only with grpo.beta > 0")
        return self._ref

    @abc.abstractmethod
    def place(self, state: TrainState) -> TrainState:
        """The state where `step` wants it (from a fresh, restored or unplaced state)."""

    @abc.abstractmethod
    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One update on a global batch -> (state, metrics: scalars still on device, so that
        `grpo.num_iterations` updates run without waiting for the host)."""

    @abc.abstractmethod
    def sampler_params(self, state: TrainState) -> nnx.State:
        """The policy's parameters on the mesh, for the sampler."""

    @abc.abstractmethod
    def unplace(self, state: TrainState) -> TrainState:
        """One copy of a placed state (what a checkpoint holds)."""


class MeshParallel(Parallel):
    """jit on the (data, fsdp, expert, tensor) mesh; the state sharded by the logical-axis rules."""

    def __init__(self, config, mesh, graphdef, optimizer, state, **kwargs):
        super().__init__(config, mesh, graphdef, optimizer, state, **kwargs)
        # From shapes and logical axes only: `state` may be abstract (`grpo-jax bench memory`).
        self.shardings, self.not_sharded = train_state_shardings(state, mesh)
        frozen = self.frozen
        self._step = make_train_step(graphdef, optimizer, config.grpo, mesh=mesh, state_shardings=self.shardings,
                                     frozen_shardings=None if frozen is None else tree_shardings(frozen),
                                     **self.step_kw)

    def place(self, state):
        return jax.device_put(state, self.shardings)

    def step(self, state, batch):
        return self._step(state, batch, self.frozen)

    def _pack_layout(self):
        rows = batch_sharding(self.mesh, 1)
        return dict(shards=rows_per_shard(self.mesh), local_bins=False,
                    place=lambda plan: jax.device_put(plan, rows))

    def lower_step(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        """`step`'s program lowered for these arguments (arrays or jax.ShapeDtypeStructs)."""
        return self._step.lower(state, batch, self.frozen)

    def sampler_params(self, state):
        return state.params

    def unplace(self, state):
        return state


class PmapParallel(Parallel):
    """pmap over the local devices: the state replicated, the batch's rows split, gradients psum'd."""

    def __init__(self, config, mesh, graphdef, optimizer, state, **kwargs):
        super().__init__(config, mesh, graphdef, optimizer, state, **kwargs)
        self.devices = jax.local_devices()
        step = bind_train_step(graphdef, optimizer, config.grpo, axis_name="devices", **self.step_kw)
        self._step = jax.pmap(step, axis_name="devices", donate_argnums=(0,), devices=self.devices)

    def place(self, state):
        return replicate(state, self.devices)

    def step(self, state, batch):
        rows = split_rows(jax.tree.map(np.asarray, batch), len(self.devices))
        state, out = self._step(state, rows)
        return state, unreplicate(out)

    def _pack_layout(self):
        return dict(shards=len(self.devices), local_bins=True, place=None)

    def sampler_params(self, state):
        return jax.device_put(unreplicate(state.params), replicated(self.mesh))

    def unplace(self, state):
        return unreplicate(state)


def make_parallel(config: RunConfig, mesh: Mesh, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                  state: TrainState, *, temperature: float, frozen: nnx.State | None = None,
                  ref_graphdef: nnx.GraphDef | None = None, critic_graphdef: nnx.GraphDef | None = None,
                  teacher: nnx.Module | None = None) -> Parallel:
    """The run's parallelism object (`config.parallelism`), over `mesh`
    (grpo_jax.runtime.devices.run_mesh), for the initial train state `state`; the keywords as
    `Parallel`'s."""
    cls = {"jit": MeshParallel, "pmap": PmapParallel}[config.parallelism]
    return cls(config, mesh, graphdef, optimizer, state, temperature=temperature, frozen=frozen,
               ref_graphdef=ref_graphdef, critic_graphdef=critic_graphdef, teacher=teacher)


def _experts(batch: Batch):
    """The sampler's experts of a mixture-of-experts batch (prompt, completion), else None."""
    return None if batch.completion_experts is None else (batch.prompt_experts, batch.completion_experts)
