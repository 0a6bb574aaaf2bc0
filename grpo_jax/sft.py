"""Supervised warm start: cross-entropy on reference completions before GRPO, run by the same command.

A policy that never produces a correct answer gets zero-variance groups and no GRPO signal; a short
supervised phase on the dataset's own answers gives it a non-zero pass rate to sharpen. The
completion is `answer_template` filled with the row's fields, followed by the end-of-sequence token.

Shape suffixes: R rows, P prompt bucket, M completion length (the sampler's max_new_tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from grpo_jax.logprobs import completion_logprobs
from grpo_jax.sampling import pad_prompts


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
