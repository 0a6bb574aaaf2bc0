"""The pure GRPO steps: `step(state, batch) -> (state, metrics)` (`train_step` with its static half,
a `StepSpec`, bound once), jitted once with donation,
and beside it the two steps that complete a batch on device: `advantages_step` (group
normalisation of the global rewards array) and `ref_logprobs_step` (the KL reference's
log-probs).

The model enters as an NNX graphdef (static) plus its parameter state (a pytree); `nnx.merge`
happens inside the step only. The step builds its loss from the batch (the loss normaliser of the
whole batch, so any number of micro-batches gives the same update) and applies it through the one
update every training step shares (grpo_jax.learner.step_factory.update: micro-batches in a scan,
a non-finite loss or gradient leaving params and optimizer state bit-identical and counted); the
host aborts after `max_consecutive_skips` in a row (`step_factory.check_skips`).

Shape suffixes: grpo_jax.shapes (R rows = N prompts x G samples, P prompt bucket, M completion tokens).
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.config import GRPOConfig, check_micro_batches
from grpo_jax.learner.grpo import GroupAdvantages, group_advantages, loss_metrics
from grpo_jax.learner.logprobs import completion_logprobs
from grpo_jax.learner.micro_batches import merge_micro_batches, split_micro_batches
from grpo_jax.learner.across import ONE_PROGRAM, Across
from grpo_jax.learner.objectives import GRPOObjective
from grpo_jax.learner.packing import PackRows, packed_logprobs
from grpo_jax.learner.step_factory import TrainState, new_state, update
from grpo_jax.models.lora import LoRAParam, has_adapters
from grpo_jax.runtime.sharding import batch_sharding, replicated, sharded_jit


@flax.struct.dataclass
class Batch:
    """One GRPO batch of R = N x G rows (row i*G + j is sample j of prompt i). Validated by
    `check_batch` where the train step takes it."""

    prompt_ids: jax.Array  # int32 [R, P], left-padded
    prompt_mask: jax.Array  # int32 [R, P]
    completion_ids: jax.Array  # int32 [R, M]
    completion_mask: jax.Array  # int32 [R, M]
    rewards: jax.Array  # float32 [R]; NaN = dropped
    advantages: jax.Array  # float32 [R]
    valid: jax.Array  # bool [R]
    zero_std: jax.Array  # bool [N]
    truncated: jax.Array  # bool [R]
    old_logprobs: jax.Array  # float32 [R, M]: the sampler's (used when num_iterations > 1)
    ref_logprobs: jax.Array | None = None  # float32 [R, M]: reference policy's (beta > 0 only)
    teacher_logprobs: jax.Array | None = None  # float32 [R, M]: the teacher's (algorithm: distill only)
    packing: PackRows | None = None  # where each row sits in its micro-batch's bins (train.packing only)
    # A mixture-of-experts policy: the experts the sampler sent each token to (models.moe), unsigned
    # integers [R, P, L, Kx] for the prompt (its prefill) and [R, M, L, Kx] for the completion (the
    # token fed at step t; a token never fed, the last, holds 0 Kx times and takes its router's choice).
    prompt_experts: jax.Array | None = None
    completion_experts: jax.Array | None = None


# field -> (dims as names of R, N, P, M, dtype kind): "i" integer, "f" float, "b" bool.
_BATCH_FIELDS = {
    "prompt_ids": (("R", "P"), "i"), "prompt_mask": (("R", "P"), "i"), "completion_ids": (("R", "M"), "i"),
    "completion_mask": (("R", "M"), "i"), "rewards": (("R",), "f"), "advantages": (("R",), "f"),
    "valid": (("R",), "b"), "zero_std": (("N",), "b"), "truncated": (("R",), "b"), "old_logprobs": (("R", "M"), "f"),
    "ref_logprobs": (("R", "M"), "f"), "teacher_logprobs": (("R", "M"), "f"),
}


def check_batch(batch: Batch, *, micro_batches: int = 1) -> None:
    """Shapes and dtypes of every field (static: free under jit), rows = N x G, and rows that split
    into `micro_batches`; a ValueError names the field that is wrong."""
    R, M = batch.completion_ids.shape
    P = batch.prompt_ids.shape[1] if batch.prompt_ids.ndim == 2 else -1
    N = batch.zero_std.shape[0] if batch.zero_std.ndim == 1 else -1
    dims = {"R": R, "N": N, "P": P, "M": M}
    for name, (shape, kind) in _BATCH_FIELDS.items():
        x = getattr(batch, name)
        if x is None and name in ("ref_logprobs", "teacher_logprobs"):
            continue
        try:
            chex.assert_shape(x, tuple(dims[d] for d in shape))
            chex.assert_type(x, {"i": int, "f": float, "b": bool}[kind])
        except AssertionError as e:
            raise ValueError(f"Batch.{name} should be {kind}{list(shape)} with R={R}, N={N}, P={P}, M={M}: "
                             f"{e}") from None
    if batch.packing is not None:
        for name in ("bin", "prompt_start", "completion_start", "completion_len"):
            x = getattr(batch.packing, name)
            if x.shape != (R,) or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"Batch.packing.{name} should be int[{R}], got {x.dtype}{list(x.shape)}")
    _check_experts(batch, R, P, M)
    if N < 1 or R % N or R // N < 2:
        raise ValueError(f"Batch.zero_std has {N} groups for {R} rows: rows must be N x G with G >= 2")
    check_micro_batches(R, micro_batches, "Batch")


def _check_experts(batch: Batch, R: int, P: int, M: int) -> None:
    """A mixture-of-experts batch's sampler experts: both or neither, integers [R, P | M, L, Kx]."""
    prompt, completion = batch.prompt_experts, batch.completion_experts
    if (prompt is None) != (completion is None):
        raise ValueError("Batch.prompt_experts and Batch.completion_experts come together (both or neither)")
    if prompt is None:
        return
    for name, x, T in (("prompt_experts", prompt, P), ("completion_experts", completion, M)):
        if x.ndim != 4 or x.shape[:2] != (R, T) or x.shape[2:] != prompt.shape[2:] or not jnp.issubdtype(
                x.dtype, jnp.integer):
            raise ValueError(f"Batch.{name} should be integers [{R}, {T}, L, Kx] (L, Kx as the other's), got "
                             f"{x.dtype}{list(x.shape)}")


def check_group_rows(rows: int, micro_batches: int, group_size: int, groups: int | None = None) -> None:
    """With a shared prompt pass (group_size > 1) the rows of each micro-batch must be whole groups
    of the batch's layout (`groups` prompts of rows / groups samples each, when known)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if group_size == 1:
        return
    if groups is not None and (rows // groups) % group_size:
        raise ValueError(f"group_size={group_size} does not divide the batch's {rows // groups} samples per prompt "
                         f"({rows} rows, {groups} prompts): pass sampling.group_size")
    if (rows // micro_batches) % group_size:
        raise ValueError(f"{rows} rows in train.micro_batches={micro_batches} give micro-batches of "
                         f"{rows // micro_batches} rows, not whole groups of group_size={group_size} (the shared "
                         "prompt pass needs whole groups): choose micro_batches (x devices) dividing the prompts")


def split_trainable(model) -> tuple[nnx.GraphDef, nnx.State, nnx.State | None]:
    """(graphdef, trainable params, frozen params or None): with LoRA adapters
    (`models.lora.add_adapters`) only they train and the base is frozen; else every parameter
    trains. `nnx.merge(graphdef, trainable, *([frozen] if frozen is not None else []))` rebuilds it."""
    if has_adapters(model):
        return nnx.split(model, LoRAParam, nnx.Param)
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params, None


def merge_model(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None):
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def init_state(model, optimizer: optax.GradientTransformation, *,
               critic: dict | None = None) -> tuple[nnx.GraphDef, TrainState]:
    """The model's graphdef and a fresh TrainState of its trainable params (`split_trainable`: the
    adapters only, for a model with LoRA adapters); with `critic` (PPO's value head) the optimizer
    holds the pair (params, critic)."""
    graphdef, params, _ = split_trainable(model)
    return graphdef, new_state(params, optimizer, critic=critic)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSpec:
    """The static half of the RL update, bound once (`bind_train_step`): the policy's structure
    (`graphdef`), the optimizer, the `grpo` section, the objective (`objectives.make_objective`:
    GRPO, PPO with its critic, distillation), micro-batches, the log-prob chunk, the sampling
    temperature, the rows that share one prompt pass (`group_size`), the seed of adapter dropout,
    where the activations' rows live on a mesh (`row_sharding`), and how a program's rows relate to
    the whole batch (`across`: one program, or the pmap mode's devices)."""

    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    config: GRPOConfig
    objective: GRPOObjective = GRPOObjective()
    micro_batches: int = 1
    logprob_chunk: int = 128
    temperature: float = 1.0
    group_size: int = 1
    seed: int = 0
    row_sharding: object = None
    across: Across = ONE_PROGRAM


def train_step(state: TrainState, batch: Batch, frozen: nnx.State | None = None, *,
               spec: StepSpec) -> tuple[TrainState, dict[str, jax.Array]]:
    """One update of `spec.objective` (GRPO's; PPO's, the state holding a critic; on-policy
    distillation's, the batch holding the teacher's log-probs). `frozen`: the parameters that do
    not train (a LoRA run's base weights), else None.

    PPO's value warm-up (`ppo.value_warmup_steps`): while state.step is below it, only the critic
    and its half of the optimizer state change; the policy's parameters and moments stay as they were.
    Split over several programs (`spec.across`: the pmap mode) each holds a slice of the rows: the
    loss normaliser and the batch metrics come from all programs' rows (gathered, they are small),
    gradients and loss sums are summed across them, so every program applies the update the whole
    batch gives, exactly as one program does.

    The gradient noise scale (`health/grad_noise_scale`) comes from the micro-batch gradients the
    step computes anyway (their squared norms, summed in the scan), over micro-batches x programs.

    group_size=G > 1 computes each group's shared prompt once in the policy pass (see
    `completion_logprobs`); every micro-batch (of every program) must then hold whole groups.

    seed: with LoRA adapter dropout (`lora.dropout`), the masks of step s, micro-batch m (program p
    under pmap) come from key(seed) folded with s, m and p: a resumed run draws what an
    uninterrupted one would."""
    objective = spec.objective
    check_batch(batch, micro_batches=spec.micro_batches)
    check_group_rows(batch.completion_ids.shape[0], spec.micro_batches, spec.group_size, batch.zero_std.shape[0])
    objective.check(state, batch)
    whole = objective.whole_batch(batch, spec.config, spec.across)
    step_key = jax.random.fold_in(jax.random.key(spec.seed), state.step)
    if (index := spec.across.index()) is not None:
        step_key = jax.random.fold_in(step_key, index)
    warmup = objective.warmup(state.step)
    micro_loss = objective.micro_loss(lambda params: merge_model(spec.graphdef, params, frozen), spec.config, whole,
                                      group_size=spec.group_size, logprob_chunk=spec.logprob_chunk,
                                      temperature=spec.temperature, row_sharding=spec.row_sharding, warmup=warmup)
    state, core, sums = update(state, micro_loss, batch.replace(zero_std=None), step_key, optimizer=spec.optimizer,
                               micro_batches=spec.micro_batches, unit=spec.group_size, across=spec.across,
                               hold_policy=warmup)
    extra = objective.metrics(sums, warmup)
    return state, {**core, **loss_metrics(sums), **_batch_metrics(whole.batch), **extra}


def _batch_metrics(batch: Batch) -> dict[str, jax.Array]:
    """Advantage and completion statistics of the batch the update saw. (Reward statistics describe
    the policy's samples before dynamic sampling filters them: grpo_jax.rollout.collect.reward_metrics.)"""
    valid = batch.valid
    n = jnp.maximum(valid.sum(), 1)
    adv = jnp.where(valid, batch.advantages, 0.0)
    adv_mean = adv.sum() / n
    lengths = batch.completion_mask.sum(axis=1)
    return {
        "advantage/mean": adv_mean,
        "advantage/std": jnp.sqrt(jnp.sum(jnp.where(valid, (adv - adv_mean) ** 2, 0.0)) / n),
        "advantage/abs_max": jnp.abs(adv).max(),
        "completion/len_mean": lengths.mean(),
        "completion/len_max": lengths.max(),
        "completion/truncated_frac": batch.truncated.mean(),
    }


def bind_train_step(spec: StepSpec):
    """`step(state, batch, frozen=None) -> (state, metrics)`: `train_step` with its static half
    bound, what `make_train_step` jits and the pmap mode (grpo_jax.learner.pmap) pmaps."""
    return functools.partial(train_step, spec=spec)


def make_train_step(spec: StepSpec, *, mesh: Mesh, state_shardings, frozen_shardings=None):
    """`step(state, batch, frozen=None)`: `train_step` jitted once on `mesh` with explicit
    shardings: the state keeps `state_shardings` (see `grpo_jax.runtime.sharding.place_train_state`)
    and its buffers are donated, the batch's rows are split over (data, fsdp, expert), the frozen
    parameters (a LoRA base) keep `frozen_shardings`, the metrics come back replicated; activations
    keep the batch's rows split (`row_sharding`)."""
    step = bind_train_step(dataclasses.replace(spec, row_sharding=batch_sharding(mesh, 1)))
    # One sharding for every field of the batch (a prefix: rows split, other dimensions whole), so
    # a batch with or without reference log-probs runs the same jitted function.
    jitted = sharded_jit(step, in_shardings=(state_shardings, batch_sharding(mesh, 1), frozen_shardings),
                         out_shardings=(state_shardings, replicated(mesh)), donate=("state",))

    def sharded_step(state: TrainState, batch: Batch, frozen: nnx.State | None = None):
        return jitted(state, batch, frozen)

    sharded_step.lower = jitted.lower  # the same program on abstract shapes (`grpo-jax bench memory`)
    return sharded_step


def advantages_step(rewards: jax.Array, *, group_size: int, config: GRPOConfig) -> GroupAdvantages:
    """Group normalisation of the whole batch's rewards (float32 [R], NaN = dropped) as configured.
    Run under jit on the global array (`make_advantages_step`), so every statistic, the batch std of
    `advantage_scale: batch` included, is the whole batch's on every host."""
    return group_advantages(rewards, group_size, scale=config.advantage_scale,
                            estimator=config.advantage_estimator, eps=config.advantage_eps, ddof=config.std_ddof)


def make_advantages_step(group_size: int, config: GRPOConfig, *, mesh: Mesh):
    """`advantages_step` jitted once on `mesh`, rewards and every output split over (data, fsdp, expert)
    (N prompts must split over data x fsdp x expert, which a run checks before compiling)."""
    step = functools.partial(advantages_step, group_size=group_size, config=config)
    rows = batch_sharding(mesh, 1)
    return sharded_jit(step, in_shardings=rows, out_shardings=GroupAdvantages(advantages=rows, valid=rows, zero_std=rows))


def ref_logprobs_step(params: nnx.State, prompt_ids: jax.Array, prompt_mask: jax.Array, completion_ids: jax.Array,
                      packing: PackRows | None = None, experts: tuple[jax.Array, jax.Array] | None = None, *,
                      graphdef, logprob_chunk: int = 128, temperature: float = 1.0, group_size: int = 1,
                      micro_batches: int = 1, row_sharding=None, replay: bool = True) -> jax.Array:
    """float32 [R, M]: log-probs of the completion tokens (int32 [R, M]) after their prompts
    (int32 [R, P], left-padded, with their mask) under `params` (the KL reference: a copy of the
    policy's params, or a LoRA run's frozen base with `graphdef` the base's structure without
    adapters), tempered as the sampler's. group_size=G > 1: each group's shared prompt runs once
    (`completion_logprobs`). row_sharding: as `train_step`'s.

    packing: the batch's packing plan (`Batch.packing`); the pass then runs over each micro-batch's
    bins in turn (`micro_batches`, as the train step cuts them), so it holds one micro-batch's
    activations at a time, as the update does.

    experts: a mixture-of-experts batch's sampler experts (`Batch.prompt_experts`,
    `Batch.completion_experts`), routed by when `replay` (`moe.routing_replay: sampler`)."""
    model = nnx.merge(graphdef, params)
    if packing is not None:
        if experts is not None:
            raise ValueError("train.packing does not run with a mixture-of-experts policy yet (its routing replay "
                             "reads unpacked rows); set train.packing: false")
        rows = split_micro_batches((prompt_ids, prompt_mask, completion_ids, packing), micro_batches, group_size)

        def one(mb):
            p_ids, p_mask, c_ids, pack = mb
            return packed_logprobs(model, pack, p_ids, p_mask, c_ids, chunk=logprob_chunk, temperature=temperature,
                                   row_sharding=row_sharding)[0]

        return merge_micro_batches(jax.lax.map(one, rows), group_size)
    check_group_rows(completion_ids.shape[0], 1, group_size)
    logp_RM, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                     chunk=logprob_chunk, temperature=temperature, group_size=group_size,
                                     row_sharding=row_sharding, experts=experts, replay=replay)
    return logp_RM


def make_ref_logprobs_step(graphdef, *, mesh: Mesh, params_shardings, logprob_chunk: int = 128,
                           temperature: float = 1.0, group_size: int = 1, micro_batches: int = 1,
                           replay: bool = True):
    """`ref_logprobs_step` jitted once on `mesh`: the reference params keep `params_shardings` and
    the rows of every input (a packing plan's too), of the activations and of the output are split
    over (data, fsdp, expert)."""
    step = functools.partial(ref_logprobs_step, graphdef=graphdef, logprob_chunk=logprob_chunk,
                             temperature=temperature, group_size=group_size, micro_batches=micro_batches,
                             row_sharding=batch_sharding(mesh, 1), replay=replay)
    rows = batch_sharding(mesh, 1)
    jitted = sharded_jit(step, in_shardings=(params_shardings, rows, rows, rows, rows, rows), out_shardings=rows)

    def sharded_step(params, prompt_ids, prompt_mask, completion_ids, packing: PackRows | None = None, experts=None):
        return jitted(params, prompt_ids, prompt_mask, completion_ids, packing, experts)

    sharded_step.lower = lambda params, prompt_ids, prompt_mask, completion_ids, packing=None, experts=None: (
        jitted.lower(params, prompt_ids, prompt_mask, completion_ids, packing, experts))  # `grpo-jax bench memory`
    return sharded_step

