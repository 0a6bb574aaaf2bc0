"""The one place a training step applies an optimizer update, and the one way a step is built from a loss.

`update` is the core every training step runs: gradients of a loss summed over micro-batches in
a scan (grpo_jax.learner.micro_batches.accumulate), summed across programs (pmap's devices), then one
optimizer update (gradient clipping is inside the optax chain, grpo_jax.learner.optimizer). A
non-finite loss or gradient leaves params and optimizer state bit-identical and is counted in the
state (`skipped_total`, `skipped_streak`; the host aborts after too many in a row:
`check_skips`).

`make_step` turns a loss into a jitted step with explicit shardings and a donated state: the
supervised warm start (grpo_jax.trainer.warm_start) and reward-model training
(grpo_jax.learner.bradley_terry) are built by it. The RL step (grpo_jax.learner.train_step) builds
its loss from the batch and the state (PPO's warm-up, a LoRA run's frozen base, metrics of the
whole batch) and calls `update` itself, jitted or pmapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.config import check_micro_batches
from grpo_jax.learner.grpo import MAX_SUMS
from grpo_jax.learner.micro_batches import accumulate, grad_noise_scale, sq_norm
from grpo_jax.learner.across import ONE_PROGRAM, Across
from grpo_jax.learner.optimizer import hold_policy_half
from grpo_jax.runtime.sharding import batch_sharding, replicated, sharded_jit

# micro_loss(trainable, micro_batch, key) -> (loss, sums): the loss of one micro-batch, already
# divided by the whole batch's normaliser (so the micro-batches' losses and gradients add up to
# the batch's), and the sums it reports (added over micro-batches; grpo.MAX_SUMS by their maximum).
MicroLoss = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32
    params: nnx.State
    opt_state: optax.OptState
    skipped_total: jax.Array  # int32: updates skipped for non-finite gradients
    skipped_streak: jax.Array  # int32: of which in a row, up to this step
    critic: dict | None = None  # algorithm: ppo: the value head (grpo_jax.learner.ppo.init_critic), trained with params


def new_state(params, optimizer: optax.GradientTransformation, *, critic: dict | None = None) -> TrainState:
    """A fresh TrainState of `params` (any pytree of arrays); with `critic` the optimizer holds the
    pair (params, critic)."""
    opt_state = optimizer.init(params if critic is None else (params, critic))
    # Distinct buffers for each counter: the step donates the whole state.
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                      skipped_total=jnp.zeros((), jnp.int32), skipped_streak=jnp.zeros((), jnp.int32), critic=critic)


def trainable_of(state: TrainState):
    """What the optimizer updates: the params, or the pair (params, critic) of a PPO state."""
    return state.params if state.critic is None else (state.params, state.critic)


def keep_if(finite: jax.Array, new, old):
    """`new` where the update is finite, else `old`, leaf by leaf (a skipped step is bit-identical)."""
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)


def apply_update(state: TrainState, grads, loss: jax.Array, optimizer: optax.GradientTransformation, *,
                 hold_policy: jax.Array | bool = False) -> tuple[TrainState, jax.Array]:
    """The optimizer's update where loss and gradients are finite; else the state bit-identical
    with the skip counted -> (state one step on, the gradient's norm). `hold_policy` (PPO's value
    warm-up, traced bool): the policy's parameters and its half of the optimizer state kept as they were."""
    trainable = trainable_of(state)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = optimizer.update(grads, state.opt_state, trainable)
    new_trainable = keep_if(finite, optax.apply_updates(trainable, updates), trainable)
    new_params, new_critic = (new_trainable, None) if state.critic is None else new_trainable
    new_opt = keep_if(finite, new_opt, state.opt_state)
    if state.critic is not None and hold_policy is not False:
        new_params = keep_if(hold_policy, state.params, new_params)
        new_opt = hold_policy_half(new_opt, state.opt_state, hold_policy)
    return TrainState(step=state.step + 1, params=new_params, opt_state=new_opt,
                      skipped_total=state.skipped_total + (~finite).astype(jnp.int32),
                      skipped_streak=jnp.where(finite, 0, state.skipped_streak + 1), critic=new_critic), grad_norm


def update(state: TrainState, micro_loss: MicroLoss, rows, step_key: jax.Array, *,
           optimizer: optax.GradientTransformation, micro_batches: int = 1, unit: int = 1,
           across: Across = ONE_PROGRAM, hold_policy: jax.Array | bool = False,
           ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
    """One update of `state` from the gradients of `micro_loss` over `rows` (a pytree of [R, ...]
    arrays) cut into `micro_batches` (runs of `unit` rows kept whole; micro-batch m draws with
    fold_in(step_key, m)) -> (state, metrics, the loss's sums over the whole batch).

    Split over several programs (`across`: the pmap mode's devices) each program's loss is
    already divided by the whole batch's normaliser, so losses, gradients and sums are summed
    across them (grpo.MAX_SUMS by their maximum) and every program applies the whole batch's update.

    metrics: `train/loss`, `train/grad_norm` (before clipping), `train/skipped_steps`,
    `train/skipped_streak` and `health/grad_noise_scale` (from the micro-batch gradients, over
    micro-batches x programs; NaN from one piece)."""
    loss, grads, sums, sq = accumulate(micro_loss, trainable_of(state), rows, step_key, micro_batches, unit=unit)
    # Each program's loss is already divided by the whole batch's normaliser: sum, don't average.
    loss, grads, sq = across.sum((loss, grads, sq))
    sums = {k: (across.max(v) if k in MAX_SUMS else across.sum(v)) for k, v in sums.items()}
    pieces, row_count = micro_batches * across.count(), jax.tree.leaves(rows)[0].shape[0] * across.count()
    noise_scale = grad_noise_scale(sq, sq_norm(grads), pieces=pieces, rows=row_count)
    state, grad_norm = apply_update(state, grads, loss, optimizer, hold_policy=hold_policy)
    metrics = {"train/loss": loss, "train/grad_norm": grad_norm, "train/skipped_steps": state.skipped_total,
               "train/skipped_streak": state.skipped_streak, "health/grad_noise_scale": noise_scale}
    return state, metrics, sums


def loss_step(state: TrainState, batch, *, loss_of: Callable[[Any], MicroLoss],
              optimizer: optax.GradientTransformation, micro_batches: int = 1, unit: int = 1,
              seed: int = 0) -> tuple[TrainState, dict[str, jax.Array]]:
    """`update` with the loss `loss_of(batch)` (what the whole batch fixes, such as its token
    count, bound before the batch is cut) -> (state, `update`'s metrics and the loss's sums).
    Micro-batch m of step s draws with key(seed) folded with s and m."""
    check_micro_batches(jax.tree.leaves(batch)[0].shape[0], micro_batches, "the batch")
    step_key = jax.random.fold_in(jax.random.key(seed), state.step)
    state, metrics, sums = update(state, loss_of(batch), batch, step_key, optimizer=optimizer,
                                  micro_batches=micro_batches, unit=unit)
    return state, {**metrics, **sums}


def make_step(loss_of: Callable[[Any], MicroLoss], optimizer: optax.GradientTransformation, *, mesh: Mesh,
              state_shardings, micro_batches: int = 1, unit: int = 1, seed: int = 0):
    """`step(state, batch) -> (state, metrics)`: `loss_step` jitted once on `mesh`, the state
    keeping `state_shardings` (a pytree prefix of a TrainState) with its buffers donated, the rows
    of every array of the batch (a pytree) split over (data, fsdp, expert), the metrics replicated.

    `loss_of(batch) -> micro_loss(trainable, micro_batch, key) -> (loss, sums)` (`MicroLoss`): a
    loss divided by what the whole batch fixes gives the same update for any `micro_batches`."""
    step = functools.partial(loss_step, loss_of=loss_of, optimizer=optimizer, micro_batches=micro_batches,
                             unit=unit, seed=seed)
    # One sharding for the whole batch (a prefix: rows split, other dimensions whole).
    return sharded_jit(step, in_shardings=(state_shardings, batch_sharding(mesh, 1)),
                       out_shardings=(state_shardings, replicated(mesh)), donate=("state",))


def check_skips(metrics: dict, max_consecutive: int) -> None:
    """Host-side: abort the run after `max_consecutive` non-finite updates in a row."""
    streak = int(metrics["train/skipped_streak"])
    if streak >= max_consecutive:
        raise FloatingPointError(
            f"{streak} consecutive train steps had a non-finite loss or gradient (updates skipped); "
            "lower the learning rate, check rewards and inputs for NaN, or enable bf16-safe settings"
        )
