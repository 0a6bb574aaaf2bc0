"""The shared prompt pass (`group_size` > 1) equals the plain pass that runs every row's own copy
of its prompt: log-probs, entropies, the GRPO loss, every gradient, a whole update."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.config import GRPOConfig, ModelConfig
from grpo_jax.learner.grpo import group_advantages, policy_loss
from grpo_jax.learner.logprobs import completion_logprobs
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.models.build import build_model
from grpo_jax.learner.train_step import Batch, init_state
from batches import one_device_ref_step, one_device_step

P, M = 7, 6
# Gemma's window (5) is shorter than prompt + completion, and its sliding layers see the window
# cut across the prompt/completion boundary.
CONFIGS = {"qwen3": tiny("qwen3"), "gemma3_text": tiny("gemma3_text", sliding_window=5)}
LOSS_CONFIG = GRPOConfig(beta=0.04, entropy_coef=0.01)


def grouped_batch(N: int, G: int, seed: int = 0, vocab: int = 256) -> Batch:
    """N prompts of different real lengths (left-padded, each repeated G times) and ragged completions."""
    rng = np.random.default_rng(seed)
    prompt = np.zeros((N, P), np.int32)
    pmask = np.zeros((N, P), np.int32)
    for i, n in enumerate(np.resize([P, 3, 1, 5], N)):
        prompt[i, P - n:] = rng.integers(3, vocab, n)
        pmask[i, P - n:] = 1
    R = N * G
    comp = rng.integers(3, vocab, (R, M)).astype(np.int32)
    cmask = (np.arange(M)[None] < rng.integers(1, M + 1, R)[:, None]).astype(np.int32)
    comp = np.where(cmask == 1, comp, 0)  # padding after the end, as the sampler leaves it
    rewards = rng.integers(0, 2, R).astype(np.float32)
    adv = group_advantages(jnp.asarray(rewards), G)
    return Batch(prompt_ids=jnp.asarray(np.repeat(prompt, G, 0)), prompt_mask=jnp.asarray(np.repeat(pmask, G, 0)),
                 completion_ids=jnp.asarray(comp), completion_mask=jnp.asarray(cmask), rewards=jnp.asarray(rewards),
                 advantages=adv.advantages, valid=adv.valid, zero_std=adv.zero_std,
                 truncated=jnp.asarray(cmask.sum(1) == M),
                 old_logprobs=jnp.asarray(rng.normal(-5.5, 0.1, (R, M)), jnp.float32),
                 ref_logprobs=jnp.asarray(rng.normal(-5.5, 0.1, (R, M)), jnp.float32))


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size"))  # one compile beats op-by-op dispatch
def logprobs_loss_grads(params, batch, *, graphdef, group_size):
    def loss(params):
        logp, entropy = completion_logprobs(nnx.merge(graphdef, params), batch.prompt_ids, batch.prompt_mask,
                                            batch.completion_ids, chunk=4, temperature=0.8, group_size=group_size)
        value, _ = policy_loss(logp, jax.lax.stop_gradient(logp), batch.advantages, batch.completion_mask,
                               LOSS_CONFIG, valid=batch.valid, truncated=batch.truncated,
                               ref_logprobs=batch.ref_logprobs, entropy=entropy)
        return value, (logp, entropy)

    (value, (logp, entropy)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logp, entropy, value, grads


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_shared_prompt_equals_a_prompt_per_row(family):
    graphdef, params = nnx.split(Transformer(CONFIGS[family], rngs=nnx.Rngs(1)), nnx.Param)
    for G in (2, 4):
        # 12 rows either way: the plain pass compiles once for both group sizes.
        batch = grouped_batch(N=12 // G, G=G, seed=G)
        plain = logprobs_loss_grads(params, batch, graphdef=graphdef, group_size=1)
        shared = logprobs_loss_grads(params, batch, graphdef=graphdef, group_size=G)
        for name, a, b in zip(("log-probs", "entropies"), plain[:2], shared[:2]):
            # Every position, the padding after a completion's end included: both passes see the same rows.
            # fp32 in another order: log-probs (~6) and entropies carry an error relative to their size
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=5e-5, atol=1e-5, err_msg=f"{name}, G={G}")
        np.testing.assert_allclose(float(shared[2]), float(plain[2]), atol=1e-5)
        grads_plain, grads_shared = nnx.to_flat_state(plain[3]), nnx.to_flat_state(shared[3])
        assert [k for k, _ in grads_plain] == [k for k, _ in grads_shared]
        for (path, a), (_, b) in zip(grads_plain, grads_shared):
            assert float(jnp.abs(a[...]).max()) > 0, f"no gradient reaches {path}"
            np.testing.assert_allclose(np.asarray(b[...]), np.asarray(a[...]), atol=1e-5, err_msg=f"{path}, G={G}")


def test_a_shared_prompt_update_equals_the_plain_update():
    # SGD with lr 1, as in test_train_step: the parameter difference is the gradient difference.
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    G = 2
    batch = grouped_batch(N=4, G=G, seed=5)
    results = []
    for group_size in (1, G):
        graphdef, state = init_state(Transformer(CONFIGS["qwen3"], rngs=nnx.Rngs(0)), opt)
        ref = one_device_ref_step(graphdef, state.params, logprob_chunk=4, group_size=group_size)
        ref_logp = ref(state.params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids)
        step = one_device_step(graphdef, opt, LOSS_CONFIG, state, micro_batches=2, logprob_chunk=4,
                               group_size=group_size)
        state, metrics = step(state, batch.replace(ref_logprobs=ref_logp + 0.01))
        results.append((ref_logp, jax.tree.leaves(state.params), float(metrics["train/loss"])))
    (ref1, p1, l1), (refG, pG, lG) = results
    np.testing.assert_allclose(np.asarray(refG), np.asarray(ref1), rtol=5e-5, atol=1e-5)  # log-probs: as above
    assert abs(l1 - lG) <= 1e-5
    for a, b in zip(p1, pG):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_a_micro_batch_that_splits_a_group_is_refused():
    opt = optax.sgd(1.0)
    graphdef, state = init_state(Transformer(CONFIGS["qwen3"], rngs=nnx.Rngs(0)), opt)
    batch = grouped_batch(N=2, G=4)  # 8 rows: 4 micro-batches of 2 rows would cut each group in two
    with pytest.raises(ValueError, match="not whole groups of group_size=4"):
        one_device_step(graphdef, opt, GRPOConfig(), state, micro_batches=4, group_size=4)(state, batch)
    with pytest.raises(ValueError, match="does not divide the batch's 4 samples per prompt"):
        one_device_step(graphdef, opt, GRPOConfig(), state, group_size=8)(state, batch)
    with pytest.raises(ValueError, match="not whole groups of group_size=3"):
        one_device_ref_step(graphdef, state.params, group_size=3)(state.params, batch.prompt_ids,
                                                                  batch.prompt_mask, batch.completion_ids)


def test_unrolled_layers_equal_the_scan():
    # scan_layers=False runs the same layers unrolled: logits, log-probs (plain and shared prompt)
    # and every gradient agree with the scan. Gemma: sliding and full layers, per-kind rope tables.
    family = "gemma3_text"
    batch = grouped_batch(N=3, G=2, seed=3)
    outs = []
    for scan in (True, False):
        model = Transformer(CONFIGS[family], rngs=nnx.Rngs(2), scan_layers=scan)
        assert model.scan_layers is scan
        graphdef, params = nnx.split(model, nnx.Param)
        ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids], axis=1)
        mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask], axis=1)
        logits = model(ids, attention_mask=mask)
        outs.append((logits, *(logprobs_loss_grads(params, batch, graphdef=graphdef, group_size=g) for g in (1, 2))))
    (scan_logits, *scanned), (unrolled_logits, *unrolled) = outs
    # fp32 in another summation order: the error grows with the value (1e-5 relative seen on one CPU)
    np.testing.assert_allclose(np.asarray(unrolled_logits), np.asarray(scan_logits), rtol=5e-5, atol=1e-5)
    for a, b in zip(scanned, unrolled):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=5e-5, atol=1e-5)


def test_a_run_builds_the_model_with_its_scan_layers_setting():
    cfg = CONFIGS["qwen3"]
    for scan in (True, False):
        model = build_model(ModelConfig(architecture={}, tokenizer="char", scan_layers=scan), cfg, seed=0)
        assert model.scan_layers is scan
