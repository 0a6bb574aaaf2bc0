"""The one optimizer builder: `make_optimizer(OptimizerConfig)`, global-norm clipping then AdamW
over fp32 master params with a learning-rate schedule; PPO pairs the policy's optimizer with its
value head's.

Every optimizer of the package is built by it from a config section's `OptimizerConfig`: the
GRPO/PPO update and its critic (`run_optimizer`), the supervised warm start
(`warm_start_optimizer`) and reward-model training (grpo_jax.trainer.reward_pairs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from grpo_jax.config import OptimizerConfig, RunConfig
from grpo_jax.learner.objectives import objective_class


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping (`config.max_grad_norm`; None: none) then AdamW at the config's
    learning-rate schedule (fp32 master params: the state is kept in the params' dtype)."""
    adam = optax.adamw(_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                       weight_decay=config.weight_decay)
    if config.max_grad_norm is None:
        return adam
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adam)


def _schedule(config: OptimizerConfig):
    """Constant (a plain float), or with linear warm-up over `warmup_steps`, or (lr_schedule
    "cosine") warm-up then cosine decay to 0 at `total_steps`."""
    if config.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, max(config.warmup_steps, 1),
                                                  config.total_steps)
    if config.warmup_steps:
        return optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
    return config.learning_rate


def learning_rate_at(config: OptimizerConfig, step: int) -> float:
    """The learning rate of update `step` (1-based: its schedule's count is step - 1)."""
    schedule = _schedule(config)
    return float(schedule(max(step - 1, 0))) if callable(schedule) else float(schedule)


def _constant(config: OptimizerConfig, learning_rate: float) -> OptimizerConfig:
    """`config` at a constant `learning_rate` (its clipping, weight decay and Adam's settings kept)."""
    return dataclasses.replace(config, learning_rate=learning_rate, lr_schedule="constant", warmup_steps=0)


def run_optimizer(config: RunConfig) -> optax.GradientTransformation:
    """The run's optimizer: the train section's (`TrainConfig.optimizer`); for `algorithm: ppo`
    paired with the critic's own, with the same settings at a constant `ppo.critic_learning_rate`
    (default: the policy's learning rate and schedule) and, for a critic model's transformer, at
    `ppo.critic_trunk_learning_rate` when set (each with its own clipping)."""
    policy = config.train.optimizer
    optimizer = make_optimizer(policy)
    if not objective_class(config).critic:
        return optimizer
    ppo = config.ppo
    critic = make_optimizer(policy if ppo.critic_learning_rate is None else _constant(policy, ppo.critic_learning_rate))
    if ppo.critic == "model" and ppo.critic_trunk_learning_rate is not None:
        trunk = make_optimizer(_constant(policy, ppo.critic_trunk_learning_rate))
        critic = optax.multi_transform({"head": critic, "trunk": trunk}, _critic_labels)
    return pair_optimizer(optimizer, critic)


def warm_start_optimizer(config: RunConfig) -> optax.GradientTransformation:
    """The supervised warm start's: AdamW at a constant `sft.learning_rate` with the train section's
    betas and optax's default weight decay (1e-4), without clipping: its cross-entropy gradients
    are not the policy gradient's heavy-tailed ones that train.max_grad_norm guards, and its
    documented results (the demo's and the tests' warm starts) were measured unclipped."""
    sft = dataclasses.replace(_constant(config.train.optimizer, config.sft.learning_rate), max_grad_norm=None,
                              weight_decay=1e-4)
    return make_optimizer(sft)


def pair_optimizer(policy: optax.GradientTransformation,
                   critic: optax.GradientTransformation) -> optax.GradientTransformation:
    """One optimizer over the pair (params, critic) of a PPO state: `policy` on the params, `critic`
    on the value head (each with its own learning rate and gradient clipping)."""
    def labels(pair):
        params, head = pair
        return (jax.tree.map(lambda _: "policy", params), jax.tree.map(lambda _: "critic", head))

    return optax.multi_transform({"policy": policy, "critic": critic}, labels)


def _critic_labels(pair):
    """A critic model's parts (inside `pair_optimizer`'s critic half, which sees the whole pair with
    the policy's leaves masked out): its transformer ("model") is "trunk", the value head "head"."""
    params, critic = pair
    return (jax.tree.map(lambda _: "head", params),
            {k: jax.tree.map(lambda _: "trunk" if k == "model" else "head", v) for k, v in critic.items()})


def hold_policy_half(new_state, old_state, hold):
    """A `pair_optimizer` state with its policy half taken from `old_state` where `hold` (traced
    bool; PPO's value warm-up): the policy's moments and step count do not move while the critic's do,
    so the policy's first real update is a fresh AdamW step (bias correction and schedule from 0)."""
    inner = dict(new_state.inner_states)
    inner["policy"] = jax.tree.map(lambda new, old: jnp.where(hold, old, new), inner["policy"],
                                   old_state.inner_states["policy"])
    return new_state._replace(inner_states=inner)
