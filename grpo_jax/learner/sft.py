"""Supervised warm start: cross-entropy on reference completions before GRPO, run by the same command.

A policy that never produces a correct answer gets zero-variance groups and no GRPO signal; a short
supervised phase on the dataset's own answers gives it a non-zero pass rate to sharpen. The
completion is `answer_template` filled with the row's fields, followed by the end-of-sequence token.

Shape suffixes: R rows, P prompt bucket, M completion length (the sampler's max_new_tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from grpo_jax.runtime.hosts import common_bucket, row_share, to_global
from grpo_jax.learner.logprobs import completion_logprobs
from grpo_jax.trainer.prepare import Prepared
from grpo_jax.rollout.sampling import pad_prompts
from grpo_jax.runtime.sharding import replicated


def sft_loss(params, graphdef, prompt_ids_RP, prompt_mask_RP, completion_ids_RM, completion_mask_RM, chunk: int):
    """Mean negative log-likelihood per completion token."""
    model = nnx.merge(graphdef, params)
    logp_RM, _ = completion_logprobs(model, prompt_ids_RP, prompt_mask_RP, completion_ids_RM, chunk=chunk)
    mask = completion_mask_RM.astype(jnp.float32)
    return -(logp_RM * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "chunk"), donate_argnames=("params", "opt_state"))
def sft_step(params, opt_state, batch, *, graphdef, optimizer: optax.GradientTransformation, chunk: int):
    loss, grads = jax.value_and_grad(sft_loss)(params, graphdef, *batch, chunk)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def completion_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                     prompt_buckets: Sequence[int], max_new_tokens: int, pad_id: int) -> tuple[np.ndarray, ...]:
    """Left-padded prompts and right-padded completions (cut at `max_new_tokens`, the sampler's limit,
    so the warm start never teaches completions the sampler cannot produce)."""
    ids_RP, mask_RP = pad_prompts(prompts, prompt_buckets, pad_id)
    comp_RM = np.full((len(completions), max_new_tokens), pad_id, np.int32)
    cmask_RM = np.zeros_like(comp_RM)
    for i, c in enumerate(completions):
        c = list(c)[:max_new_tokens]
        comp_RM[i, :len(c)] = c
        cmask_RM[i, :len(c)] = 1
    return ids_RP, mask_RP, comp_RM, cmask_RM


def warm_start(prepared: Prepared, model, log: Callable[[str], None]) -> list[float]:
    """The supervised phase (`sft.steps` steps) on the train split's reference answers, data-parallel
    over the run's mesh (each host builds its block of every batch); updates `model` in place and
    returns the losses."""
    cfg, sampling, mesh = prepared.config.sft, prepared.sampling, prepared.mesh
    tok = prepared.tokenizer
    eos = sampling.stop_token_ids[0]
    share = row_share(mesh, cfg.batch_size)
    t = prepared.config.train
    optimizer = optax.adamw(cfg.learning_rate, b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps)
    graphdef, params = nnx.split(model, nnx.Param)
    # Moments follow their params; the step count goes on the mesh too, replicated, so the step's
    # inputs keep one sharding from call to call (else the second call compiles again).
    opt_state = jax.tree.map(lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
                             else jax.device_put(x, replicated(mesh)), optimizer.init(params))
    losses = []
    for i in range(cfg.steps):
        examples = prepared.sft_stream.next_batch(share.size)
        answers = [tok.encode(cfg.answer_template.format(**ex.fields), add_special_tokens=False) + [eos]
                   for ex in examples]
        prompts = [ex.prompt_ids for ex in examples]
        batch = completion_batch(prompts, answers, prompt_buckets=common_bucket(prompts, sampling.prompt_buckets),
                                 max_new_tokens=sampling.max_new_tokens, pad_id=sampling.pad_id)
        params, opt_state, loss = sft_step(params, opt_state, to_global(batch, mesh, share),
                                           graphdef=graphdef, optimizer=optimizer, chunk=t.logprob_chunk)
        losses.append(float(loss))
        if (i + 1) % max(1, cfg.steps // 5) == 0 or i + 1 == cfg.steps:
            log(f"sft step {i + 1}/{cfg.steps}: loss {np.mean(losses[-10:]):.4f}")
    nnx.update(model, params)
    return losses
