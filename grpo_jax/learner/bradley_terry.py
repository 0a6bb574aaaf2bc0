"""The reward model's objective: the Bradley-Terry loss on preference pairs,

    loss = mean over pairs of -log sigmoid(r(prompt, chosen) - r(prompt, rejected) - margin)
           + lm_coef * (the backbone's next-token cross-entropy on the chosen answers' tokens),

and its train and scoring steps, built by the step factory (grpo_jax.learner.step_factory) as the
RL and warm-start steps are. The pairs and the run: grpo_jax.trainer.reward_pairs and reward_run.

Shape letters: grpo_jax.shapes (B pairs of a batch, T tokens, E embedding width).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.learner.logprobs import chunked_logprobs
from grpo_jax.learner.step_factory import TrainState, make_step
from grpo_jax.models.reward_model import RewardModel
from grpo_jax.runtime.sharding import batch_sharding, replicated, sharded_jit, tree_shardings


def bt_loss(r_chosen: jax.Array, r_rejected: jax.Array, margin: jax.Array) -> jax.Array:
    """Bradley-Terry: mean of -log sigmoid(r_chosen - r_rejected - margin), float32 [B] each."""
    return jnp.mean(jax.nn.softplus(-(r_chosen - r_rejected - margin)))


def answer_nll(model: RewardModel, h_BTE: jax.Array, ids_BT: jax.Array, mask_BT: jax.Array,
               answer_start_B: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of the tokens at and after `answer_start` (int32 [B]) of each
    row, predicted by the backbone (tied embedding) from the hidden states h [B, T, E] before them."""
    logp_BT, _ = chunked_logprobs(h_BTE[:, :-1], ids_BT[:, 1:], model.backbone.logits)
    T = ids_BT.shape[1]
    keep_BT = (jnp.arange(1, T)[None, :] >= answer_start_B[:, None]) & (mask_BT[:, 1:] > 0)
    keep_BT = keep_BT.astype(jnp.float32)
    return -jnp.sum(logp_BT * keep_BT) / jnp.maximum(jnp.sum(keep_BT), 1.0)


def pair_scores(model: RewardModel, ids_B2T, mask_B2T):
    """(r_chosen [B], r_rejected [B], the chosen rows' hidden states [B, T, E])."""
    B, _, T = ids_B2T.shape
    r, h = model.scores_and_states(ids_B2T.reshape(2 * B, T), mask_B2T.reshape(2 * B, T))
    r = r[:, 0].reshape(B, 2)
    return r[:, 0], r[:, 1], h.reshape(B, 2, T, -1)[:, 0]


def pair_loss(pairs, *, graphdef, lm_coef: float = 0.0):
    """The Bradley-Terry loss of a batch of `pairs` (ids, mask [B, 2, T], margin, answer_start [B])
    as the step factory takes it (`MicroLoss`): `bt_loss`, plus `lm_coef` times the chosen answers'
    `answer_nll`, with `rm/loss`, `rm/lm_loss` (only with `lm_coef`: without, no logits are
    computed, and a real model's vocabulary makes them the largest tensor of the step),
    `rm/accuracy` and `rm/reward_margin` as its sums. Means over the batch it is given: the
    reward model trains on one micro-batch, so nothing of the whole batch is bound."""
    def micro_loss(params, micro, key):
        ids, mask, margin, answer_start = micro
        model = nnx.merge(graphdef, params)
        rc, rr, h_BTE = pair_scores(model, ids, mask)
        terms = {"rm/loss": bt_loss(rc, rr, margin)}
        if lm_coef:
            terms["rm/lm_loss"] = answer_nll(model, h_BTE, ids[:, 0], mask[:, 0], answer_start)
        loss = terms["rm/loss"] + lm_coef * terms.get("rm/lm_loss", 0.0)
        return loss, {**terms, "rm/accuracy": jnp.mean(rc > rr), "rm/reward_margin": jnp.mean(rc - rr)}

    return micro_loss


def make_steps(graphdef, optimizer, mesh, state: TrainState, *, lm_coef: float = 0.0):
    """(train step, scoring step), jitted once. The train step is the step factory's with
    `pair_loss` (`train(state, (ids, mask, margin, answer_start)) -> (state, metrics)`): the state
    keeps the shardings it has (params as `place_model` gave them, Adam's moments made from them,
    the rest replicated: `on_mesh`) and is donated, the pairs' rows are split over data x fsdp x expert.
    `score(params, ids, mask) -> (r_chosen, r_rejected)`."""
    def score_step(params, ids, mask):
        return pair_scores(nnx.merge(graphdef, params), ids, mask)[:2]

    shardings = tree_shardings(state)
    train = make_step(functools.partial(pair_loss, graphdef=graphdef, lm_coef=lm_coef), optimizer, mesh=mesh,
                      state_shardings=shardings)
    rows = batch_sharding(mesh, 1)  # a prefix: the pairs' rows split, the rest whole
    score = sharded_jit(score_step, in_shardings=(shardings.params, rows, rows), out_shardings=replicated(mesh))
    return train, score
