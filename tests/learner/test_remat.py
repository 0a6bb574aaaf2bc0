"""model.remat in the train step: every policy gives the same update, and the compiled step keeps
less for its backward pass with `block` than with `none`."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from batches import long_batch, one_device_step
from flax import nnx

from grpo_jax.config import GRPOConfig, ModelConfig
from grpo_jax.learner.train_step import Batch, init_state
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny


def _step(remat: str, batch: Batch):
    """One SGD(lr=1) step (new params = params - grads) -> (the compiled step's memory, params, metrics)."""
    optimizer = optax.sgd(1.0)
    graphdef, state = init_state(Transformer(tiny("qwen3", num_layers=3), rngs=nnx.Rngs(0), remat=remat), optimizer)
    step = one_device_step(graphdef, optimizer, GRPOConfig(), state, micro_batches=2, logprob_chunk=16)
    compiled = step.lower(state, batch, None).compile()
    new_state, metrics = compiled(state, batch, None)
    return compiled.memory_analysis(), new_state.params, metrics


def test_every_remat_policy_gives_the_same_update_and_block_keeps_less():
    batch = long_batch()
    memory, params, metrics = {}, {}, {}
    for remat in ("none", "block", "dots", "attention", "offload"):
        memory[remat], params[remat], metrics[remat] = _step(remat, batch)
    for remat in ("block", "dots", "attention", "offload"):
        for key in ("train/loss", "train/grad_norm"):
            np.testing.assert_allclose(float(metrics[remat][key]), float(metrics["none"][key]), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(params[remat]), jax.tree.leaves(params["none"])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert float(metrics["none"]["train/grad_norm"]) > 0.01  # the update moved the params: compared above
    temps = {k: v.temp_size_in_bytes for k, v in memory.items()}
    # Measured (the tests' compile flags): none 9.7 MB, block 3.5 MB, dots 4.3 MB of temporaries.
    assert temps["block"] < 0.7 * temps["none"], temps
    assert temps["dots"] < temps["none"], temps
    assert temps["attention"] < temps["none"], temps


def test_remat_attention_never_reruns_the_chunked_forward():
    # The chunked path's forward is one loop per layer; `remat: block` runs it again in the backward
    # pass (one more loop per layer), `remat: attention` keeps its residuals and does not.
    ids = jax.numpy.ones((1, 64), jax.numpy.int32)
    loops = {}
    for remat in ("none", "block", "attention"):
        model = Transformer(tiny("qwen3", num_layers=2), rngs=nnx.Rngs(0), remat=remat, attention="chunked")
        graphdef, params = nnx.split(model, nnx.Param)
        grad = jax.grad(lambda p: nnx.merge(graphdef, p).hidden_states(ids).sum())
        loops[remat] = jax.jit(grad).lower(params).as_text().count("stablehlo.while")
    assert loops["attention"] == loops["none"] < loops["block"], loops


def test_remat_attention_keeps_qkv_and_outputs_in_the_shared_prompt_pass():
    # The train step's grouped pass names q/k/v and attention's outputs as the plain pass does, so
    # `remat: attention` saves them there too (an attention without names of its own inside, as xla
    # or the Pallas kernels, would otherwise keep what `block` keeps).
    import contextlib
    import io

    from grpo_jax.models.grouped import grouped_hidden_states

    ids = jax.numpy.ones((2, 64), jax.numpy.int32)
    saved = {}
    for remat in ("block", "attention"):
        model = Transformer(tiny("qwen3", num_layers=2), rngs=nnx.Rngs(0), remat=remat, attention="xla")
        graphdef, params = nnx.split(model, nnx.Param)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(
                lambda p: grouped_hidden_states(nnx.merge(graphdef, p), ids[:1], None, ids)[1].sum(), params)
        saved[remat] = len(out.getvalue().splitlines())
    # q, k, v of the prompt and of the completions, and the two outputs: 8 more stacked residuals.
    assert saved["attention"] == saved["block"] + 8, saved


def test_a_remat_that_is_not_a_choice_is_refused():
    with pytest.raises(ValueError, match=r"model.remat='full' is not one of \['none', 'block', 'dots', 'attention', 'offload'\]"):
        ModelConfig(tokenizer="char", architecture={"family": "qwen3"}, remat="full")
    with pytest.raises(ValueError, match=r"remat=True is not one of \['none', 'block', 'dots', 'attention', 'offload'\]"):
        Transformer(tiny("qwen3"), rngs=nnx.Rngs(0), remat=True)


def test_an_mlp_run_in_chunks_of_the_sequence_equals_the_whole(monkeypatch):
    # 300 tokens in chunks of 64 (the last one padded), under `remat: offload`: the logits and every
    # gradient equal the unchunked MLP's (Gemma 3: a GELU MLP with its post-norm).
    from grpo_jax.models import layers

    cfg = tiny("gemma3_text")
    ids = jax.numpy.asarray(np.random.default_rng(1).integers(3, 256, (2, 300)), jax.numpy.int32)
    w = jax.numpy.asarray(np.random.default_rng(2).normal(size=(2, 300, cfg.vocab_size)), jax.numpy.float32)
    out = {}
    for chunk in (64, 4096):
        monkeypatch.setattr(layers, "MLP_CHUNK", chunk)
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), remat="offload"), nnx.Param)

        def loss(params):
            logits = nnx.merge(graphdef, params)(input_ids=ids)
            return jax.numpy.sum(logits * w), logits

        fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
        out[chunk] = (fn(params), fn.lower(params).as_text().count("stablehlo.while"))
    ((_, logits), grads), loops = out[64]
    ((_, want), want_grads), want_loops = out[4096]
    assert loops > want_loops, (loops, want_loops)  # the chunked MLP is a loop of its own
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max() + 1e-6
