"""The one optimizer factory: global-norm clipping then AdamW over fp32 master params, with the
run's learning-rate schedule; PPO pairs the policy's optimizer with its value head's.

Every trainer builds its optimizer here: the GRPO/PPO update (`run_optimizer`), the supervised warm
start (grpo_jax.trainer.warm_start) and reward-model training (grpo_jax.tools.reward_training).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from grpo_jax.config import RunConfig


def make_optimizer(learning_rate, *, max_grad_norm: float | None = 1.0, weight_decay: float = 0.0,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """Global-norm clipping (`max_grad_norm`; None: none) then AdamW (fp32 master params: the
    state is kept in the params' dtype). `learning_rate`: a float or an optax schedule."""
    adam = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if max_grad_norm is None:
        return adam
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adam)


def schedule(learning_rate: float, *, warmup_steps: int = 0, total_steps: int = 0, kind: str = "constant"):
    """Constant, or with linear warm-up over `warmup_steps`, or (kind "cosine") warm-up then cosine
    decay to 0 at `total_steps`."""
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(warmup_steps, 1), total_steps)
    if warmup_steps:
        return optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return learning_rate


def learning_rate(config: RunConfig):
    """The policy's learning rate: constant, or with linear warm-up, or warm-up then cosine decay."""
    t = config.train
    return schedule(t.learning_rate, warmup_steps=t.warmup_steps, total_steps=t.steps, kind=t.lr_schedule)


def run_optimizer(config: RunConfig) -> optax.GradientTransformation:
    """The run's optimizer: `make_optimizer` with the train section's settings; for `algorithm:
    ppo` paired with the critic's own (`ppo.critic_learning_rate`, default the policy's; a critic
    model's transformer at `ppo.critic_trunk_learning_rate` when set, each with its own clipping)."""
    t = config.train
    adam = dict(max_grad_norm=t.max_grad_norm, weight_decay=t.weight_decay, b1=t.adam_b1, b2=t.adam_b2,
                eps=t.adam_eps)
    optimizer = make_optimizer(learning_rate(config), **adam)
    if config.algorithm != "ppo":
        return optimizer
    ppo = config.ppo
    critic = make_optimizer(ppo.critic_learning_rate or learning_rate(config), **adam)
    if ppo.critic == "model" and ppo.critic_trunk_learning_rate is not None:
        trunk = make_optimizer(ppo.critic_trunk_learning_rate, **adam)
        critic = optax.multi_transform({"head": critic, "trunk": trunk}, _critic_labels)
    return pair_optimizer(optimizer, critic)


def warm_start_optimizer(config: RunConfig) -> optax.GradientTransformation:
    """The supervised warm start's: AdamW at `sft.learning_rate` with the train section's betas and
    optax's default weight decay (1e-4), without clipping: its cross-entropy gradients are not the
    policy gradient's heavy-tailed ones that train.max_grad_norm guards, and its documented
    results (the demo's and the tests' warm starts) were measured unclipped."""
    t = config.train
    return make_optimizer(config.sft.learning_rate, max_grad_norm=None, weight_decay=1e-4, b1=t.adam_b1,
                          b2=t.adam_b2, eps=t.adam_eps)


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
