"""Retention metrics (grpo_jax.rollout.retention) on fixed inputs: the bucketed KL against NumPy
(exact at k = V, a lower bound below), KL of identical policies is exactly 0, a known shift of the
logits gives its known KL, the NLL is the full forward pass's, and a mesh gives one device's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.data.tokenizer import char_tokenizer
from grpo_jax.models import Transformer, TransformerConfig
from grpo_jax.rollout.retention import Retention, bucketed_kl, build_corpus, read_rows
from grpo_jax.runtime.sharding import make_mesh, one_device_mesh, place_model
from grpo_jax.config import MeshConfig

TOK = char_tokenizer(add_bos=True)
CFG = TransformerConfig(family="llama", vocab_size=len(TOK), hidden_size=16, intermediate_size=32, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=4)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(p0_log, p_log):
    return (np.exp(p0_log) * (p0_log - p_log)).sum(-1)


def test_bucketed_kl_is_numpys_exact_at_k_equal_v_and_a_lower_bound_below():
    rng = np.random.default_rng(0)
    lp0, lp = log_softmax(rng.normal(size=(5, 16)) * 2), log_softmax(rng.normal(size=(5, 16)) * 2)
    order = np.argsort(-lp0, axis=-1)
    for k in (16, 4):
        ids = order[:, :k]
        got = np.asarray(bucketed_kl(jnp.asarray(np.take_along_axis(lp0, ids, -1), jnp.float32), jnp.asarray(ids),
                                     jnp.asarray(lp, jnp.float32)))
        p0k, pk = np.take_along_axis(np.exp(lp0), ids, -1), np.take_along_axis(np.exp(lp), ids, -1)
        buckets0 = np.concatenate([p0k, 1 - p0k.sum(-1, keepdims=True)], -1).clip(1e-30)
        buckets = np.concatenate([pk, 1 - pk.sum(-1, keepdims=True)], -1).clip(1e-30)
        np.testing.assert_allclose(got, (buckets0 * np.log(buckets0 / buckets)).sum(-1), atol=2e-6)
        if k == 16:
            np.testing.assert_allclose(got, kl(lp0, lp), atol=2e-6)
        else:
            assert (got < kl(lp0, lp) - 1e-3).all() and (got > 0).all()


@pytest.fixture(scope="module")
def setup():
    corpus = build_corpus(TOK, read_rows()[:6] + read_rows()[-2:], max_tokens=24)
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    return corpus, model


def full_logp(model, corpus):
    """NumPy log-probs [N, M, V] of each target position from one plain forward pass."""
    ids = np.concatenate([corpus.context_ids, corpus.target_ids], 1)
    mask = np.concatenate([corpus.context_mask, np.ones_like(corpus.target_ids)], 1)
    logits = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)), np.float64)
    P = corpus.context_ids.shape[1]
    return log_softmax(logits[:, P - 1:-1])


def test_identical_policies_give_zero_kl_and_the_nll_is_the_forward_passs(setup):
    corpus, model = setup
    assert corpus.target_mask.sum() > 100 and corpus.context_mask[:, -1].all()
    probe = Retention(corpus, mesh=one_device_mesh(), k=8, chunk=16)
    probe.reference(model)
    m = probe.metrics(model)
    assert m["retention/kl"] == 0.0 and m["retention/tokens"] == corpus.target_mask.sum()
    lp = full_logp(model, corpus)
    nll = -np.take_along_axis(lp, corpus.target_ids[..., None], -1)[..., 0]
    assert m["retention/general_nll"] == pytest.approx((nll * corpus.target_mask).sum() / corpus.target_mask.sum(),
                                                       rel=1e-5)
    order = np.argsort(-lp, -1)[..., :8]
    np.testing.assert_array_equal(probe.ref.top_ids[corpus.target_mask > 0], order[corpus.target_mask > 0])


def test_a_known_shift_of_the_logits_gives_its_known_kl_on_one_device_and_on_a_mesh(setup):
    corpus, model = setup
    shifted = nnx.clone(model)
    shifted.lm_head[...] = shifted.lm_head[...].at[:, 7].add(0.5)  # one token's logit moves with the state
    lp0, lp = full_logp(model, corpus), full_logp(shifted, corpus)
    want = (kl(lp0, lp) * corpus.target_mask).sum() / corpus.target_mask.sum()
    assert want > 1e-3
    got = {}
    for name, mesh in (("one", one_device_mesh()), ("mesh", make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))):
        probe = Retention(corpus, mesh=mesh, k=CFG.vocab_size, chunk=16)
        a, b = nnx.clone(model), nnx.clone(shifted)
        place_model(a, mesh), place_model(b, mesh)
        probe.reference(a)
        got[name] = probe.metrics(b)
        assert got[name]["retention/kl"] == pytest.approx(want, rel=1e-4)
    assert got["mesh"]["retention/general_nll"] == pytest.approx(got["one"]["retention/general_nll"], rel=1e-5)
    below = Retention(corpus, mesh=one_device_mesh(), k=4, chunk=16)
    below.reference(model)
    assert 0 < below.metrics(shifted)["retention/kl"] < want


def test_a_saved_reference_reads_back_on_a_mesh_that_pads_the_corpus_to_more_rows(setup, tmp_path):
    corpus, model = setup  # 8 rows: one device pads none; a mesh of 3 row shards would pad to 9
    probe = Retention(corpus, mesh=one_device_mesh(), k=8)
    probe.begin(model, tmp_path, resumed=False, primary=True, log=print)
    padded = build_corpus(TOK, read_rows()[:6] + read_rows()[-2:], max_tokens=24,
                          mesh=make_mesh(MeshConfig(data=1, fsdp=3, tensor=1), jax.devices()[:3]))
    assert padded.target_ids.shape[0] == 9
    again = Retention(padded, mesh=one_device_mesh(), k=8)
    again.begin(model, tmp_path, resumed=True, primary=True, log=print)
    np.testing.assert_array_equal(again.ref.top_ids[:8], probe.ref.top_ids)
    assert again.metrics(model)["retention/kl"] == 0.0
    other = Retention(build_corpus(TOK, read_rows()[:3], max_tokens=24), mesh=one_device_mesh(), k=8)
    with pytest.raises(ValueError, match="kept on another retention corpus"):
        other.begin(model, tmp_path, resumed=True, primary=True, log=print)
