"""The objectives, one per `algorithm`, chosen once from the config (`make_objective`): the loss
of one micro-batch (`micro_loss`) and what it needs from the whole batch first (`whole_batch`):
GRPO's clipped surrogate on group advantages (`GRPOObjective`), PPO's on GAE with its critic (a
head or a separate model, `learner.ppo`: `PPOObjective`), distillation's on the teacher's per-token
advantages (`learner.distill`: `DistillObjective`). The train step (grpo_jax.learner.train_step)
accumulates it over micro-batches; `across.Across` says how a program's rows make the whole batch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config import DistillConfig, GRPOConfig, PPOConfig
from grpo_jax.learner.distill import distill_advantages, reverse_kl_sum
from grpo_jax.learner.grpo import effective_mask, loss_weights, policy_loss
from grpo_jax.learner.across import Across
from grpo_jax.learner.logprobs import chunked_logprobs, completion_states
from grpo_jax.learner.packing import packed_logprobs
from grpo_jax.learner.ppo import critic_values, explained_variance, positive_mask, ppo_loss
from grpo_jax.models.moe import Routing, aux_loss
from grpo_jax.models.moe import metrics as moe_metrics


@dataclasses.dataclass(frozen=True)
class WholeBatch:
    """Per-row fields of the whole batch (for its metrics) and the loss's normalisers, gathered
    from every program (`Across.gather`)."""

    batch: object  # a train_step.Batch with the gathered fields
    normaliser: jax.Array  # the policy term's (`loss_weights` of the whole batch)
    positive_tokens: jax.Array  # tokens of rows with a reward > 0 (`ppo.positive_lm_coef`'s loss; else 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOObjective:
    """GRPO's clipped surrogate (or CISPO's, `grpo.policy_loss`) on group advantages; the base of
    every objective (`OBJECTIVES`: one per `algorithm`, chosen once by `make_objective`). A
    mixture-of-experts policy: routed by the sampler's experts when `replay` (`moe.routing_replay:
    sampler`), its load-balancing loss weighted by `aux_loss_coef` (None: the model's
    `router_aux_loss_coef`)."""

    replay: bool = True
    aux_loss_coef: float | None = None
    critic: ClassVar[bool] = False  # the train state holds a critic (PPO's)
    teacher: ClassVar[bool] = False  # the batch holds a teacher's log-probs (distillation's)
    counts_positive_tokens: ClassVar[bool] = False  # the loss reads the positive rows' tokens (VAPO's LM term)

    def check(self, state, batch) -> None:
        """A state or batch this objective cannot train on: a ValueError saying what is missing."""
        if (state.critic is not None) != self.critic:
            raise ValueError(f"{type(self).__name__} trains a state {'with' if self.critic else 'without'} a critic; "
                             f"this one has {'none' if self.critic else 'one'} (algorithm: ppo holds one)")

    def warmup(self, step: jax.Array) -> jax.Array | bool:
        """True (traced) while only a critic trains (PPO's value warm-up); False otherwise."""
        return False

    def whole_batch(self, batch, config: GRPOConfig, across: Across) -> WholeBatch:
        """`WholeBatch` of `batch` (a train_step.Batch), from every program's rows."""
        positive = self.counts_positive_tokens
        if not across.whole:
            batch = batch.replace(**{f: across.gather(getattr(batch, f)) for f in (
                "advantages", "valid", "truncated", "completion_mask", *(("rewards",) if positive else ()))})
        mask_RM = effective_mask(batch.completion_mask, config, valid=batch.valid, truncated=batch.truncated)
        return WholeBatch(batch=batch, normaliser=loss_weights(mask_RM, config)[1],
                          positive_tokens=positive_mask(batch).sum() if positive else jnp.float32(1.0))

    def micro_loss(self, merge, config: GRPOConfig, whole: WholeBatch, *, group_size: int, logprob_chunk: int,
                   temperature: float, row_sharding=None, warmup: jax.Array | bool = False):
        """`loss(trainable, micro_batch, dropout_key) -> (loss, sums)`; `merge(params)`: the policy
        model with these trainable parameters."""

        def micro_loss(trainable, mb, key):
            params, critic = trainable if self.critic else (trainable, None)
            model = merge(params)
            logp_RM, entropy_RM, h_RME, routed = self._policy_pass(model, mb, key, group_size=group_size,
                                                                   logprob_chunk=logprob_chunk,
                                                                   temperature=temperature, row_sharding=row_sharding)
            # mu = 1: the rollout's policy is the current one; its log-probs are these, without a second pass.
            old_RM = mb.old_logprobs if config.num_iterations > 1 else jax.lax.stop_gradient(logp_RM)
            loss, sums = self.loss(critic, h_RME, logp_RM, old_RM, entropy_RM, mb, config, whole, warmup=warmup,
                                   group_size=group_size, row_sharding=row_sharding)
            return with_router_terms(loss, sums, routed, mb, whole, self._aux_coef(model))

        return micro_loss

    def _policy_pass(self, model, mb, key, *, group_size, logprob_chunk, temperature, row_sharding):
        """(log-probs [R, M], entropies [R, M], hidden states [R, M, E] or None (packed), routing or None)."""
        # The key is only read by adapters with dropout (`Layers.arrays`); otherwise nothing is drawn.
        if mb.packing is not None:  # over the micro-batch's bins (train.packing; not with PPO's critic)
            if mb.completion_experts is not None:
                raise ValueError("train.packing does not run with a mixture-of-experts policy yet (its routing "
                                 "replay reads unpacked rows); set train.packing: false")
            logp_RM, entropy_RM = packed_logprobs(model, mb.packing, mb.prompt_ids, mb.prompt_mask,
                                                  mb.completion_ids, chunk=logprob_chunk, temperature=temperature,
                                                  dropout_key=key, row_sharding=row_sharding)
            return logp_RM, entropy_RM, None, None
        experts = None if mb.completion_experts is None else (mb.prompt_experts, mb.completion_experts)
        if experts is None and self.replay and model.config.is_moe:
            raise ValueError("moe.routing_replay: sampler needs the sampler's experts in the batch "
                             "(Batch.prompt_experts, Batch.completion_experts); every engine records them, "
                             "or set moe.routing_replay: none")
        h_RME, routed = completion_states(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                          group_size=group_size, dropout_key=key, row_sharding=row_sharding,
                                          experts=experts, replay=self.replay,
                                          completion_mask=mb.completion_mask, with_routing=True)
        logp_RM, entropy_RM = chunked_logprobs(h_RME, mb.completion_ids, model.logits, chunk=logprob_chunk,
                                               temperature=temperature)
        return logp_RM, entropy_RM, h_RME, routed

    def loss(self, critic, h_RME, logp_RM, old_RM, entropy_RM, mb, config: GRPOConfig, whole: WholeBatch, **_):
        """One micro-batch's (loss, sums) from the policy's log-probs."""
        advantages, extra = self.advantages(mb, old_RM, config)
        loss, sums = policy_loss(logp_RM, old_RM, advantages, mb.completion_mask, config, valid=mb.valid,
                                 truncated=mb.truncated, ref_logprobs=mb.ref_logprobs, entropy=entropy_RM,
                                 normaliser=whole.normaliser, sampler_logprobs=mb.old_logprobs)
        return loss, {**sums, **extra}

    def advantages(self, mb, old_RM, config: GRPOConfig) -> tuple[jax.Array, dict]:
        """The advantages the surrogate weighs (the batch's group advantages) and extra sums."""
        return mb.advantages, {}

    def metrics(self, sums: dict, warmup) -> dict[str, jax.Array]:
        """The step's metrics beyond `loss_metrics`' per-token means, taken out of `sums`: the
        routers' and the `_`-prefixed whole-batch figures."""
        extra = router_metrics(sums)
        extra.update({k[1:]: sums.pop(k) for k in list(sums) if k.startswith("_")})
        return extra

    def _aux_coef(self, model) -> float:
        return model.config.router_aux_loss_coef if self.aux_loss_coef is None else self.aux_loss_coef


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillObjective(GRPOObjective):
    """On-policy distillation: GRPO's surrogate on the teacher's per-token advantages
    (`learner.distill`), the batch holding the teacher's log-probs."""

    distill: DistillConfig
    teacher: ClassVar[bool] = True

    def check(self, state, batch) -> None:
        super().check(state, batch)
        if batch.teacher_logprobs is None:
            raise ValueError("algorithm: distill needs the teacher's log-probs in the batch (Batch.teacher_logprobs)")

    def advantages(self, mb, old_RM, config: GRPOConfig) -> tuple[jax.Array, dict]:
        mask_RM = effective_mask(mb.completion_mask, config, valid=mb.valid, truncated=mb.truncated)
        return (distill_advantages(mb.teacher_logprobs, old_RM, mb.advantages, self.distill),
                {"distill/reverse_kl": reverse_kl_sum(mb.teacher_logprobs, old_RM, mask_RM)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOObjective(GRPOObjective):
    """PPO's clipped surrogate on GAE with its critic (`learner.ppo`): a value head on the policy's
    states (`critic_graphdef` None) or a separate critic model of that structure."""

    ppo: PPOConfig
    critic_graphdef: nnx.GraphDef | None = None
    critic: ClassVar[bool] = True

    @property
    def counts_positive_tokens(self) -> bool:
        return self.ppo.positive_lm_coef > 0

    def warmup(self, step: jax.Array) -> jax.Array | bool:
        """While PPO's value warm-up lasts (steps 0 .. ppo.value_warmup_steps - 1)."""
        return step < self.ppo.value_warmup_steps if self.ppo.value_warmup_steps else False

    def loss(self, critic, h_RME, logp_RM, old_RM, entropy_RM, mb, config: GRPOConfig, whole: WholeBatch, *,
             warmup, group_size, row_sharding):
        if mb.packing is not None:
            raise ValueError("train.packing does not run with algorithm: ppo (its critic reads unpacked states)")
        v_RM = critic_values(critic, h_RME, mb, critic_graphdef=self.critic_graphdef, warmup=warmup,
                             group_size=group_size, row_sharding=row_sharding)
        return ppo_loss(v_RM, logp_RM, old_RM, entropy_RM, mb, config, self.ppo, whole.normaliser,
                        warmup=warmup, positive_tokens=whole.positive_tokens)

    def metrics(self, sums: dict, warmup) -> dict[str, jax.Array]:
        extra = {"value/explained_variance": explained_variance(
                     {k[len("value/_"):]: sums.pop(k) for k in list(sums) if k.startswith("value/_")}),
                 "value/warmup": jnp.asarray(warmup, jnp.float32)}
        return {**extra, **super().metrics(sums, warmup)}


# `algorithm` -> its objective: the one place an algorithm's name picks its loss.
OBJECTIVES = {"grpo": GRPOObjective, "ppo": PPOObjective, "distill": DistillObjective}


def objective_class(config) -> type[GRPOObjective]:
    """The objective a run's `config.algorithm` names: what the run builds around it asks this
    (`critic`: a critic to build and optimise; `teacher`: a teacher to load)."""
    return OBJECTIVES[config.algorithm]


def make_objective(config, *, critic_graphdef: nnx.GraphDef | None = None) -> GRPOObjective:
    """The objective of a run's `config` (a RunConfig: `algorithm`, its `ppo` / `distill` section
    and `moe`); `critic_graphdef`: a separate critic model's structure (`ppo.critic: model`)."""
    moe = dict(replay=config.moe.routing_replay == "sampler", aux_loss_coef=config.moe.aux_loss_coef)
    cls = objective_class(config)
    own = {PPOObjective: dict(ppo=config.ppo, critic_graphdef=critic_graphdef),
           DistillObjective: dict(distill=config.distill)}.get(cls, {})
    return cls(**moe, **own)


ROUTER_SUMS = ("counts", "prob_sums", "tokens", "mismatch")
"""The `moe.Routing` statistics a step's sums carry (as `moe/_<name>`), summed over micro-batches
and devices; `router_metrics` turns them into the step's `moe/*` metrics."""


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
