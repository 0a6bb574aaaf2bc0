"""Supervised warm start: cross-entropy on reference completions before GRPO, run by the same command.

A policy that never produces a correct answer gets zero-variance groups and no GRPO signal; a short
supervised phase on the dataset's own answers gives it a non-zero pass rate to sharpen. The
completion is `answer_template` filled with the row's fields, followed by the end-of-sequence token;
with an environment, it is a worked episode (`sft.turns`; grpo_jax.episodes.runner.worked_episodes),
the loss on its model turns only.

Shape suffixes: grpo_jax.shapes (R rows, P prompt bucket, M the sampler's max_new_tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from grpo_jax.config import ConfigError
from grpo_jax.runtime.hosts import common_bucket, row_share, to_global
from grpo_jax.learner.logprobs import completion_logprobs
from grpo_jax.learner.optimizer import warm_start_optimizer
from grpo_jax.learner.step_factory import TrainState, check_skips, make_step, new_state
from grpo_jax.trainer.preemption import stop_point
from grpo_jax.trainer.prepare import Prepared
from grpo_jax.episodes.runner import trajectory_capacity, worked_episodes
from grpo_jax.engine.sampling import pad_prompts
from grpo_jax.runtime.sharding import on_mesh, tree_shardings


def sft_loss(batch, *, graphdef, chunk: int):
    """The warm start's loss of a batch (ids and masks as `completion_batch`'s) as the step factory
    takes it (`MicroLoss`): the negative log-likelihood of a micro-batch's completion tokens over
    the whole batch's count of them (a mean per token, whatever the micro-batches)."""
    tokens = jnp.maximum(batch[3].astype(jnp.float32).sum(), 1.0)

    def micro_loss(params, micro, key):
        prompt_ids, prompt_mask, completion_ids, completion_mask = micro
        logp_RM, _ = completion_logprobs(nnx.merge(graphdef, params), prompt_ids, prompt_mask, completion_ids,
                                         chunk=chunk)
        return -(logp_RM * completion_mask.astype(jnp.float32)).sum() / tokens, {}

    return micro_loss


def make_sft_step(graphdef, optimizer: optax.GradientTransformation, *, mesh, state: TrainState, chunk: int):
    """`step(state, batch) -> (state, metrics)`: the step factory's step with `sft_loss` on `mesh`
    (one micro-batch), the state keeping its shardings (params placed by the rules, the rest
    replicated: `on_mesh`) and donated, the batch's rows split."""
    return make_step(functools.partial(sft_loss, graphdef=graphdef, chunk=chunk), optimizer, mesh=mesh,
                     state_shardings=tree_shardings(state))


def completion_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                     prompt_buckets: Sequence[int], max_new_tokens: int, pad_id: int,
                     loss_masks: Sequence[Sequence[int]] | None = None) -> tuple[np.ndarray, ...]:
    """Left-padded prompts and right-padded completions (cut at `max_new_tokens`, the sampler's limit,
    so the warm start never teaches completions the sampler cannot produce). The loss covers every
    completion token, or those where `loss_masks` (one per completion) is 1."""
    ids_RP, mask_RP = pad_prompts(prompts, prompt_buckets, pad_id)
    comp_RM = np.full((len(completions), max_new_tokens), pad_id, np.int32)
    cmask_RM = np.zeros_like(comp_RM)
    for i, c in enumerate(completions):
        c = list(c)[:max_new_tokens]
        comp_RM[i, :len(c)] = c
        cmask_RM[i, :len(c)] = 1 if loss_masks is None else list(loss_masks[i])[:len(c)]
    return ids_RP, mask_RP, comp_RM, cmask_RM


def worked_batch(prepared: Prepared, examples, counts: dict) -> tuple[list, list, list | None, int]:
    """(prompts, completions, loss masks, width) of one warm-start batch: the reference answers, or
    with an environment its worked episodes (a failed one keeps its row with an empty loss mask and
    is counted in `counts`; a batch where every episode failed raises, naming the first error)."""
    sampling, cfg = prepared.rollout.sampling, prepared.config.sft
    eos = sampling.stop_token_ids[0]
    if prepared.rollout.episodes is None:
        tok = prepared.model.tokenizer
        answers = [tok.encode(cfg.answer_template.format(**ex.fields), add_special_tokens=False) + [eos]
                   for ex in examples]
        return [ex.prompt_ids for ex in examples], answers, None, sampling.max_new_tokens
    played = worked_episodes(prepared.rollout.episodes, examples, cfg.turns, sampling.stop_token_ids)
    stop_point()  # a stop signal gave up on the environment's calls: stop here, not as a failed batch
    failed = [ep.error for ep in played if ep.error is not None]
    if len(failed) == len(played):
        raise ConfigError(f"sft: every worked episode of the batch failed; the first: {failed[0]}")
    counts["failed"] += len(failed)
    counts["first"] = counts["first"] or (failed[0] if failed else None)
    prompts = [ep.prompt_ids if ep.error is None else [sampling.pad_id] for ep in played]
    ids = [ep.ids if ep.error is None else [] for ep in played]
    masks = [ep.loss_mask if ep.error is None else [] for ep in played]
    return prompts, ids, masks, trajectory_capacity(prepared.rollout.episodes.limits)


def warm_start(prepared: Prepared, model, log: Callable[[str], None]) -> list[float]:
    """The supervised phase (`sft.steps` steps) on the train split's reference answers, data-parallel
    over the run's mesh (each host builds its block of every batch); updates `model` in place and
    returns the losses. A stop signal before a step ends it there (`preemption.stop_point`: the
    run stops, nothing saved)."""
    cfg, sampling, mesh = prepared.config.sft, prepared.rollout.sampling, prepared.mesh
    share = row_share(mesh, cfg.batch_size)
    t = prepared.config.train
    optimizer = warm_start_optimizer(prepared.config)
    graphdef, params = nnx.split(model, nnx.Param)
    # Moments follow their params; the counters go on the mesh too, replicated.
    state = on_mesh(new_state(params, optimizer), mesh)
    step = make_sft_step(graphdef, optimizer, mesh=mesh, state=state, chunk=t.logprob_chunk)
    losses, counts = [], {"failed": 0, "first": None}
    for i in range(cfg.steps):
        stop_point()
        examples = prepared.sft_stream.next_batch(share.size)
        prompts, completions, masks, width = worked_batch(prepared, examples, counts)
        batch = completion_batch(prompts, completions, prompt_buckets=common_bucket(prompts, sampling.prompt_buckets),
                                 max_new_tokens=width, pad_id=sampling.pad_id, loss_masks=masks)
        state, metrics = step(state, to_global(batch, mesh, share))
        metrics = {k: float(v) for k, v in metrics.items()}
        check_skips(metrics, t.max_consecutive_skips)
        losses.append(metrics["train/loss"])
        if (i + 1) % max(1, cfg.steps // 5) == 0 or i + 1 == cfg.steps:
            log(f"sft step {i + 1}/{cfg.steps}: loss {np.mean(losses[-10:]):.4f}")
    if counts["failed"]:
        log(f"sft: {counts['failed']} worked episodes failed and were left out of the loss; "
            f"the first: {counts['first']}")
    nnx.update(model, state.params)
    return losses
