"""Chunked log-probs equal the full log-softmax; their memory grows with the chunk, not the sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.learner.logprobs import chunked_logprobs, completion_logprobs
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny


def _reference(logits, targets, temperature):
    z = np.asarray(logits, np.float64) / temperature
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return np.take_along_axis(logp, targets[..., None], -1)[..., 0], -(np.exp(logp) * logp).sum(-1)


def test_chunked_equals_full_pass_for_any_chunk():
    rng = np.random.default_rng(0)
    B, T, E, V = 2, 37, 8, 50
    h = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(E, V)), jnp.float32)
    targets = rng.integers(0, V, (B, T))
    ref_lp, ref_ent = _reference(np.asarray(h) @ np.asarray(W), targets, 0.7)
    for chunk in (1, 8, 37, 64):
        lp, ent = chunked_logprobs(h, jnp.asarray(targets), lambda x: x @ W, chunk=chunk, temperature=0.7)
        # fp32 against float64: a few roundings (~1e-7 relative each) of log-probs up to ~20 in size
        np.testing.assert_allclose(np.asarray(lp), ref_lp, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=1e-5, atol=1e-5)


def test_completion_logprobs_match_the_model_forward():
    model = Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 256, (3, 6)).astype(np.int32)
    pmask = np.ones_like(prompt)
    pmask[1, :2] = 0
    comp = rng.integers(3, 256, (3, 5)).astype(np.int32)
    lp, _ = completion_logprobs(model, jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(comp), chunk=2)
    logits = model(jnp.asarray(np.concatenate([prompt, comp], 1)),
                   attention_mask=jnp.asarray(np.concatenate([pmask, np.ones_like(comp)], 1)))
    ref, _ = _reference(np.asarray(logits)[:, 5:-1], comp, 1.0)
    # fp32 in another summation order: the error grows with the value (1e-5 relative seen on one CPU)
    np.testing.assert_allclose(np.asarray(lp), ref, rtol=5e-5, atol=1e-5)


def _grad_temp_bytes(T, chunk, B=2, E=16, V=8192):
    W = jnp.ones((E, V), jnp.float32) * 0.01
    h = jnp.ones((B, T, E), jnp.float32)
    t = jnp.zeros((B, T), jnp.int32)
    f = jax.jit(jax.grad(lambda h: chunked_logprobs(h, t, lambda x: x @ W, chunk=chunk)[0].sum()))
    return f.lower(h).compile().memory_analysis().temp_size_in_bytes


def test_peak_memory_grows_with_the_chunk_not_the_sequence():
    full_logits_bytes = 2 * 1024 * 8192 * 4  # what a [B, T, V] float32 logits array would take
    chunked_long = _grad_temp_bytes(1024, 32)
    chunked_short = _grad_temp_bytes(256, 32)
    whole = _grad_temp_bytes(1024, 1024)
    assert chunked_long < full_logits_bytes / 8, (chunked_long, full_logits_bytes)
    assert chunked_long < whole / 8, (chunked_long, whole)
    # 4x the sequence at the same chunk: far less than 4x the memory (only [B, T] and [B, T, E] grow).
    assert chunked_long < 2 * chunked_short + 1_000_000, (chunked_long, chunked_short)
