"""The loss of one micro-batch, for each algorithm (`micro_loss_fn`), and what it needs from the
whole batch first (`whole_batch`): GRPO's clipped surrogate on group advantages, PPO's on GAE with
its critic (a head or a separate model, `learner.ppo`), distillation's on the teacher's per-token
advantages (`learner.distill`). The train step (grpo_jax.learner.train_step) accumulates it over
micro-batches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config import DistillConfig, GRPOConfig, PPOConfig
from grpo_jax.learner.distill import distill_advantages, reverse_kl_sum
from grpo_jax.learner.grpo import effective_mask, loss_weights, policy_loss
from grpo_jax.learner.logprobs import chunked_logprobs, completion_states
from grpo_jax.learner.packing import packed_logprobs
from grpo_jax.learner.ppo import critic_values, positive_mask, ppo_loss
from grpo_jax.models.moe import Routing, aux_loss
from grpo_jax.models.moe import metrics as moe_metrics


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the loss is, beyond the `grpo` section: PPO's (`ppo`, with `critic_graphdef` the
    structure of a separate critic model, else None for the head) or distillation's (`distill`)."""

    ppo: PPOConfig | None = None
    distill: DistillConfig | None = None
    critic_graphdef: nnx.GraphDef | None = None
    # A mixture-of-experts policy: route by the sampler's experts (`moe.routing_replay: sampler`),
    # and the load-balancing loss's weight (None: the model's `router_aux_loss_coef`).
    replay: bool = True
    aux_loss_coef: float | None = None


@dataclasses.dataclass(frozen=True)
class WholeBatch:
    """Per-row fields of the whole batch (for its metrics) and the loss's normalisers, gathered
    from every device under pmap."""

    batch: object  # a train_step.Batch with the gathered fields
    normaliser: jax.Array  # the policy term's (`loss_weights` of the whole batch)
    positive_tokens: jax.Array  # tokens of rows with a reward > 0 (`ppo.positive_lm_coef`'s loss; else 1)


def whole_batch(batch, config: GRPOConfig, objective: Objective, axis_name: str | None) -> WholeBatch:
    """`WholeBatch` of `batch` (a train_step.Batch): under pmap from every device's rows. The
    positive tokens are counted only for a loss that reads them (`ppo.positive_lm_coef`)."""
    positive = objective.ppo is not None and objective.ppo.positive_lm_coef > 0
    if axis_name is not None:
        def gather(x):
            return jax.lax.all_gather(x, axis_name, tiled=True)

        batch = batch.replace(**{f: gather(getattr(batch, f)) for f in (
            "advantages", "valid", "truncated", "completion_mask", *(("rewards",) if positive else ()))})
    mask_RM = effective_mask(batch.completion_mask, config, valid=batch.valid, truncated=batch.truncated)
    return WholeBatch(batch=batch, normaliser=loss_weights(mask_RM, config)[1],
                      positive_tokens=positive_mask(batch).sum() if positive else jnp.float32(1.0))


def micro_loss_fn(merge, config: GRPOConfig, objective: Objective, whole: WholeBatch, *,
                  group_size: int, logprob_chunk: int, temperature: float, row_sharding=None,
                  warmup: jax.Array | bool = False):
    """`loss(trainable, micro_batch, dropout_key) -> (loss, sums)`: GRPO's objective, PPO's when
    `objective.ppo` is set (then `trainable` is the pair (params, critic); `warmup`: VAPO's value
    pretraining, see `ppo.ppo_loss`), distillation's when `objective.distill` is. `merge(params)`:
    the policy model with these trainable parameters."""
    ppo = objective.ppo

    def micro_loss(trainable, mb, key):
        params, critic = trainable if ppo is not None else (trainable, None)
        model = merge(params)
        # The key is only read by adapters with dropout (`Layers.arrays`); otherwise nothing is drawn.
        routed = None
        if mb.packing is not None:  # over the micro-batch's bins (train.packing; not with PPO's critic)
            if mb.completion_experts is not None:
                raise ValueError("train.packing does not run with a mixture-of-experts policy yet (its routing "
                                 "replay reads unpacked rows); set train.packing: false")
            logp_RM, entropy_RM = packed_logprobs(model, mb.packing, mb.prompt_ids, mb.prompt_mask,
                                                  mb.completion_ids, chunk=logprob_chunk, temperature=temperature,
                                                  dropout_key=key, row_sharding=row_sharding)
        else:
            experts = None if mb.completion_experts is None else (mb.prompt_experts, mb.completion_experts)
            if experts is None and objective.replay and model.config.is_moe:
                raise ValueError("moe.routing_replay: sampler needs the sampler's experts in the batch "
                                 "(Batch.prompt_experts, Batch.completion_experts); every engine records them, "
                                 "or set moe.routing_replay: none")
            h_RME, routed = completion_states(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                              group_size=group_size, dropout_key=key, row_sharding=row_sharding,
                                              experts=experts, replay=objective.replay,
                                              completion_mask=mb.completion_mask, with_routing=True)
            logp_RM, entropy_RM = chunked_logprobs(h_RME, mb.completion_ids, model.logits, chunk=logprob_chunk,
                                                   temperature=temperature)
        # mu = 1: the rollout's policy is the current one; its log-probs are these, without a second pass.
        old_RM = mb.old_logprobs if config.num_iterations > 1 else jax.lax.stop_gradient(logp_RM)
        if ppo is not None:
            if mb.packing is not None:
                raise ValueError("train.packing does not run with algorithm: ppo (its critic reads unpacked states)")
            v_RM = critic_values(critic, h_RME, mb, critic_graphdef=objective.critic_graphdef, warmup=warmup,
                                 group_size=group_size, row_sharding=row_sharding)
            loss, sums = ppo_loss(v_RM, logp_RM, old_RM, entropy_RM, mb, config, ppo, whole.normaliser,
                                  warmup=warmup, positive_tokens=whole.positive_tokens)
            return with_router_terms(loss, sums, routed, mb, whole, _aux_coef(objective, model))
        advantages, extra = mb.advantages, {}
        if objective.distill is not None:
            advantages = distill_advantages(mb.teacher_logprobs, old_RM, mb.advantages, objective.distill)
            mask_RM = effective_mask(mb.completion_mask, config, valid=mb.valid, truncated=mb.truncated)
            extra = {"distill/reverse_kl": reverse_kl_sum(mb.teacher_logprobs, old_RM, mask_RM)}
        loss, sums = policy_loss(logp_RM, old_RM, advantages, mb.completion_mask, config, valid=mb.valid,
                                 truncated=mb.truncated, ref_logprobs=mb.ref_logprobs, entropy=entropy_RM,
                                 normaliser=whole.normaliser, sampler_logprobs=mb.old_logprobs)
        return with_router_terms(loss, {**sums, **extra}, routed, mb, whole, _aux_coef(objective, model))

    return micro_loss


def policy_frozen(step: jax.Array, objective: Objective) -> jax.Array | bool:
    """True (traced) while PPO's value warm-up lasts: steps 0 .. ppo.value_warmup_steps - 1."""
    if objective.ppo is None or not objective.ppo.value_warmup_steps:
        return False
    return step < objective.ppo.value_warmup_steps


ROUTER_SUMS = ("counts", "prob_sums", "tokens", "mismatch")
"""The `moe.Routing` statistics a step's sums carry (as `moe/_<name>`), summed over micro-batches
and devices; `router_metrics` turns them into the step's `moe/*` metrics."""


def _aux_coef(objective: Objective, model) -> float:
    coef = objective.aux_loss_coef
    return model.config.router_aux_loss_coef if coef is None else coef


def with_router_terms(loss, sums: dict, routed, mb, whole: WholeBatch, aux_coef: float):
    """A mixture-of-experts policy's additions to a micro-batch's (loss, sums): the load-balancing
    loss times its coefficient, weighted by the micro-batch's share of the batch's completion
    tokens (the micro-batches' terms sum to about the batch's), and the routers' statistics."""
    if routed is None:
        return loss, sums
    share = mb.completion_mask.sum() / jnp.maximum(whole.batch.completion_mask.sum(), 1)
    if aux_coef:
        loss = loss + aux_coef * share * aux_loss(routed)
    # Without the sampler's experts there is nothing to compare the router with: no mismatch figure.
    names = ROUTER_SUMS if mb.completion_experts is not None else ROUTER_SUMS[:-1]
    return loss, {**sums, **{f"moe/_{name}": getattr(routed, name) for name in names}}


def router_metrics(sums: dict) -> dict[str, jax.Array]:
    """`moe/aux_loss`, `moe/expert_load_max`, `moe/routing_mismatch` of the step, from (and taken
    out of) its sums; {} for a dense policy."""
    if "moe/_counts" not in sums:
        return {}
    stats = {name: sums.pop(f"moe/_{name}", None) for name in ROUTER_SUMS}
    compared = stats["mismatch"] is not None
    out = moe_metrics(Routing(experts=None, **{**stats, "mismatch": stats["mismatch"] if compared else 0.0}))
    return out if compared else {k: v for k, v in out.items() if k != "moe/routing_mismatch"}
