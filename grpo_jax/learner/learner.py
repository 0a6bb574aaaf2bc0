"""The learner: one object the loop updates, built once from the config for the run's parallelism
(grpo_jax.learner.modes.make_learner: the one place that asks which mode a run is in).

`Learner.update(state, trajectories)` completes a rollout source's finished groups on device (group
advantages of the whole batch, the KL reference's and a teacher's log-probs, the packing plan) and
applies `grpo.num_iterations` updates of the run's objective (`objectives.make_objective`) through
`step(state, batch)`; `place` puts a fresh, restored or unplaced train state where the step wants
it, `params` gives the policy's parameters for the sampler, `unplace` one copy for a checkpoint.
The KL reference (`reference`) is a copy of the starting parameters, or a LoRA run's frozen base;
it is saved with each checkpoint and restored with it.

- `parallelism: jit` (`MeshLearner`): one (data, fsdp, expert, tensor) mesh for sampling and
  training; the train state is placed by the logical-axis rules (grpo_jax.runtime.sharding) and
  the train step is jitted with explicit in/out shardings.
- `parallelism: pmap` (grpo_jax.learner.pmap.PmapLearner): pure data parallelism on one host.

Either way a batch enters `step` as global arrays on `mesh` (rows split over data x fsdp x expert),
the steps that complete a batch (advantages, reference log-probs) run jitted on that mesh, and
every step and sharding is built when the object is (from the run's initial state, which may be
abstract: `grpo-jax bench memory`), none on first use.
"""

from __future__ import annotations

import abc
import functools
import time

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.config import RunConfig
from grpo_jax.learner.grpo import GroupAdvantages
from grpo_jax.learner.objectives import make_objective
from grpo_jax.learner.packing import pack_batch, plan_packing
from grpo_jax.learner.step_factory import TrainState, check_skips
from grpo_jax.learner.train_step import (Batch, StepSpec, make_advantages_step, make_ref_logprobs_step,
                                         make_train_step)
from grpo_jax.models.layers import parents_supported
from grpo_jax.runtime.sharding import (batch_sharding, param_shardings, rows_per_shard, train_state_shardings,
                                       tree_shardings)


class Learner(abc.ABC):
    """What both modes share: the update loop, the batch's completion, the advantage and
    reference log-prob steps on the mesh."""

    def __init__(self, config: RunConfig, mesh: Mesh, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                 state: TrainState, *, temperature: float, frozen: nnx.State | None = None,
                 ref_graphdef: nnx.GraphDef | None = None, critic_graphdef: nnx.GraphDef | None = None,
                 teacher: nnx.Module | None = None, reference: nnx.State | None = None, model_config=None):
        """`state`: the run's initial train state (its structure and the params' logical axes fix
        every sharding); `frozen`: the parameters that do not train (a LoRA run's base, placed
        with the model), else None; `ref_graphdef`: the KL reference's structure (a LoRA run's base
        without its adapters: no adapter matmuls, no copy of the weights), else the policy's;
        `critic_graphdef`: a separate critic model's structure (`ppo.critic: model`); `teacher`:
        on-policy distillation's teacher, placed on `mesh`; `reference`: the KL reference's
        parameters when `grpo.beta` > 0 and the policy has no frozen base (a copy of its own);
        `model_config`: the policy's TransformerConfig (what its attention can run decides packing's
        layout; needed with train.packing)."""
        self.mesh, self.frozen = mesh, frozen
        t, g = config.train, config.grpo
        self.num_iterations, self.beta, self.max_consecutive_skips = g.num_iterations, g.beta, t.max_consecutive_skips
        self.reference = reference  # saved in checkpoints; None for LoRA (the base is on disk) or beta 0
        self.spec = StepSpec(graphdef=graphdef, optimizer=optimizer, config=g,
                             objective=make_objective(config, critic_graphdef=critic_graphdef),
                             micro_batches=t.micro_batches, logprob_chunk=t.logprob_chunk, temperature=temperature,
                             # rows that share one prompt pass
                             group_size=config.sampling.group_size if t.shared_prompt else 1, seed=t.seed)
        self.teacher, self._teacher, self._teacher_graphdef = None, None, None
        if teacher is not None:
            self._teacher_graphdef, self.teacher = nnx.split(teacher, nnx.Param)
            self._teacher = self.teacher_scorer(group_size=self.spec.group_size, temperature=temperature)
        self.packing = None
        if t.packing:
            if jax.process_count() > 1:
                raise ValueError("train.packing plans its bins from the whole batch on one host; with "
                                 f"{jax.process_count()} processes set train.packing: false (not supported yet)")
            self.packing = dict(length=config.pack_length, micro_batches=t.micro_batches,
                                unit=self.spec.group_size, group_size=config.sampling.group_size,
                                shared=t.shared_prompt and parents_supported(config.model.attention, model_config,
                                                                                     mesh))
        self._advantages = make_advantages_step(config.sampling.group_size, g, mesh=mesh)
        self._ref = None
        if g.beta > 0:
            # The reference is a LoRA run's frozen base (placed with the model) or a copy of the
            # policy's params (placed by the rules, like the state's).
            shardings = tree_shardings(frozen) if frozen is not None else param_shardings(state.params, mesh).shardings
            self._ref = make_ref_logprobs_step(graphdef if ref_graphdef is None else ref_graphdef, mesh=mesh,
                                               params_shardings=shardings, logprob_chunk=t.logprob_chunk,
                                               temperature=temperature, group_size=self.spec.group_size,
                                               micro_batches=t.micro_batches, replay=self.spec.objective.replay)
        self.not_sharded: list[str] = []  # parameter dimensions their mesh axis could not split

    # --- the loop's calls -------------------------------------------------------------------------
    def update(self, state: TrainState, trajectories, while_waiting=None) -> tuple[TrainState, dict[str, float]]:
        """`grpo.num_iterations` updates on one step's trajectories -> (state, the update's metrics).
        `while_waiting()` runs after the updates are dispatched, before their results are read (a
        pipelined source samples its next batch while the learner's programs run)."""
        batch, completed = self.complete(trajectories)
        t0 = time.perf_counter()
        for i in range(self.num_iterations):
            state, out = self.step(state, batch)
            if i == 0:  # sampler vs trainer: only the first update sees the sampler's policy
                drift = {k: v for k, v in out.items() if k.startswith("health/sampler_train")}
        ahead_s = 0.0
        if while_waiting is not None:
            t1 = time.perf_counter()
            while_waiting()
            ahead_s = time.perf_counter() - t1
        metrics = {k: float(v) for k, v in {**out, **drift}.items()}  # waits for the last update
        train_s = time.perf_counter() - t0 - ahead_s  # the learner's own time, less the sampling beside it
        check_skips(metrics, self.max_consecutive_skips)
        if while_waiting is not None:
            metrics["perf/ahead_s"] = ahead_s  # sampling the next batch, during the update
        metrics.update({"perf/train_tokens_per_s": trajectories.tokens * self.num_iterations / max(train_s, 1e-9),
                        **completed, "perf/train_s": train_s,
                        "perf/prompt_len": float(batch.prompt_ids.shape[1])})
        return state, metrics

    def complete(self, trajectories) -> tuple[Batch, dict[str, float]]:
        """The train step's batch from a source's `Trajectories`: advantages of the whole batch, its
        packing plan (train.packing), (beta > 0) the reference's log-probs and (distillation) the
        teacher's -> (batch, metrics: `perf/ref_s`, the seconds the reference and teacher passes
        took, and with packing `perf/pack_fill`, the share of the bins' tokens that are real)."""
        t = trajectories.rows
        adv = self.advantages(t.rewards)
        batch = Batch(prompt_ids=t.prompt_ids, prompt_mask=t.prompt_mask, completion_ids=t.completion_ids,
                      completion_mask=t.completion_mask, rewards=t.rewards, truncated=t.truncated,
                      old_logprobs=t.old_logprobs, advantages=adv.advantages, valid=adv.valid, zero_std=adv.zero_std,
                      prompt_experts=t.prompt_experts, completion_experts=t.completion_experts)
        batch, fill = self.pack(batch)
        t0 = time.perf_counter()
        if self.teacher is not None:  # on-policy distillation: the teacher scores the tokens
            batch = batch.replace(teacher_logprobs=self.teacher_logprobs(batch))
        if self.beta > 0:
            reference = self.reference if self.frozen is None else self.frozen
            batch = batch.replace(ref_logprobs=self.ref_logprobs(reference, batch))
        # Waiting for them costs nothing (the update needs them next) and times them on their own.
        jax.block_until_ready((batch.ref_logprobs, batch.teacher_logprobs))
        return batch, {"perf/ref_s": time.perf_counter() - t0, **({} if fill is None else {"perf/pack_fill": fill})}

    def params(self, state: TrainState) -> nnx.State:
        """The policy's parameters on the mesh, for the sampler."""
        return state.params

    def footprint(self, state: TrainState) -> dict[str, int]:
        """Bytes the learner holds between steps, by part."""
        def nbytes(tree) -> int:
            return int(sum(x.nbytes for x in jax.tree.leaves(tree)))

        return {"trainable_params_bytes": nbytes(state.params), "optimizer_state_bytes": nbytes(state.opt_state),
                "critic_params_bytes": nbytes(state.critic),
                "frozen_params_bytes": nbytes(self.frozen), "reference_params_bytes": nbytes(self.reference),
                "teacher_params_bytes": nbytes(self.teacher)}

    # --- the batch's completion on the mesh -------------------------------------------------------
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

    def teacher_scorer(self, *, group_size: int, temperature: float):
        """`score(prompt_ids [R, P], prompt_mask [R, P], completion_ids [R, M]) -> the teacher's
        log-probs [R, M]` at `temperature`, rows in groups of `group_size` sharing a prompt pass
        (the training batch's, or held-out evaluation's k); None without a teacher."""
        if self.teacher is None:
            return None
        step = make_ref_logprobs_step(self._teacher_graphdef, mesh=self.mesh, params_shardings=tree_shardings(
            self.teacher), logprob_chunk=self.spec.logprob_chunk, temperature=temperature, group_size=group_size,
            micro_batches=self.spec.micro_batches)
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

    # --- what each mode does its own way -----------------------------------------------------------
    @abc.abstractmethod
    def _pack_layout(self) -> dict:
        """How the step's rows split into shards for `plan_packing` (`shards`, `local_bins`, `place`)."""

    @abc.abstractmethod
    def place(self, state: TrainState) -> TrainState:
        """The state where `step` wants it (from a fresh, restored or unplaced state)."""

    @abc.abstractmethod
    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One update on a global batch -> (state, metrics: scalars still on device, so that
        `grpo.num_iterations` updates run without waiting for the host)."""

    @abc.abstractmethod
    def unplace(self, state: TrainState) -> TrainState:
        """One copy of a placed state (what a checkpoint holds)."""


class MeshLearner(Learner):
    """jit on the (data, fsdp, expert, tensor) mesh; the state sharded by the logical-axis rules."""

    def __init__(self, config, mesh, graphdef, optimizer, state, **kwargs):
        super().__init__(config, mesh, graphdef, optimizer, state, **kwargs)
        # From shapes and logical axes only: `state` may be abstract (`grpo-jax bench memory`).
        self.shardings, self.not_sharded = train_state_shardings(state, mesh)
        frozen = self.frozen
        self._step = make_train_step(self.spec, mesh=mesh, state_shardings=self.shardings,
                                     frozen_shardings=None if frozen is None else tree_shardings(frozen))

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

    def unplace(self, state):
        return state


def _experts(batch: Batch):
    """The sampler's experts of a mixture-of-experts batch (prompt, completion), else None."""
    return None if batch.completion_experts is None else (batch.prompt_experts, batch.completion_experts)
