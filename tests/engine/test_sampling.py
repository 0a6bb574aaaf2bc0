"""The group sampler: parity with transformers' generate, exact log-probs, sampling statistics,
shared prefill == repeated prompts, stop-token bookkeeping, determinism, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from hf_models import build_hf_model

from grpo_jax.config import SamplingConfig
from grpo_jax.models import from_pretrained
from grpo_jax.engine.sampling import Rollout, check_rollout, generate, pad_prompts, sample_tokens

PROMPTS = [[5, 9, 13, 40, 41, 7, 8], [22, 23], [60, 61, 62, 63]]


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text"])
def models(request, tmp_path_factory):
    hf = build_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, from_pretrained(path)


def _teacher_forced_logprobs(model, rollout, temperature):
    """log softmax(logits / T) of a full pass over prompt + completion, at the sampled tokens."""
    G = rollout.group_size
    p_ids = np.repeat(np.asarray(rollout.prompt_ids), G, axis=0)
    p_mask = np.repeat(np.asarray(rollout.prompt_mask), G, axis=0)
    ids = np.concatenate([p_ids, np.asarray(rollout.tokens)], axis=1)
    mask = np.concatenate([p_mask, np.ones_like(np.asarray(rollout.tokens))], axis=1)
    logits = np.asarray(jax.jit(lambda i, m: model(i, attention_mask=m))(ids, mask), np.float64)
    P = p_ids.shape[1]
    pred = logits[:, P - 1:-1] / (temperature or 1.0)
    logp = pred - np.log(np.exp(pred - pred.max(-1, keepdims=True)).sum(-1, keepdims=True)) - pred.max(-1, keepdims=True)
    return np.take_along_axis(logp, np.asarray(rollout.tokens)[..., None], axis=-1)[..., 0]


def test_greedy_matches_transformers_generate(models):
    hf, ours = models
    M = 10
    cfg = SamplingConfig(group_size=2, max_new_tokens=M, temperature=0.0, prompt_buckets=(8,))
    out = generate(ours, PROMPTS, cfg, jax.random.key(0))
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    with torch.no_grad():
        ref = hf.generate(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                          max_new_tokens=M, min_new_tokens=M, do_sample=False, pad_token_id=0,
                          eos_token_id=None).numpy()[:, ids.shape[1]:]
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens[0::2], ref)
    np.testing.assert_array_equal(tokens[1::2], ref)  # greedy: every sample of a group is the same
    assert np.asarray(out.mask).all() and np.asarray(out.truncated).all()


def test_logprobs_equal_teacher_forced_pass(models):
    _, ours = models
    for temperature in (0.7, 0.0):
        cfg = SamplingConfig(group_size=3, max_new_tokens=12, temperature=temperature, prompt_buckets=(8,))
        out = generate(ours, PROMPTS, cfg, jax.random.key(1))
        ref = _teacher_forced_logprobs(ours, out, temperature)
        m = np.asarray(out.mask).astype(bool)
        assert np.abs(np.asarray(out.logprobs)[m] - ref[m]).max() <= 1e-4


def test_shared_prefill_equals_repeated_prompts(models):
    _, ours = models
    cfg = SamplingConfig(group_size=4, max_new_tokens=12, temperature=1.0, top_k=20, prompt_buckets=(8,),
                         engine="static")
    shared = generate(ours, PROMPTS, cfg, jax.random.key(2))
    repeated = generate(ours, PROMPTS, cfg, jax.random.key(2), share_prefill=False)
    with pytest.raises(ValueError, match="share_prefill=False is the static engine's reference path"):
        generate(ours, PROMPTS, SamplingConfig(**{**cfg.__dict__, "engine": "paged"}), jax.random.key(2),
                 share_prefill=False)
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(repeated.tokens))
    np.testing.assert_array_equal(np.asarray(shared.mask), np.asarray(repeated.mask))
    # fp32 in another summation order: the error grows with the value (1e-5 relative seen on one CPU)
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(repeated.logprobs), rtol=5e-5, atol=1e-5)
    # Samples of one group differ (it is sampling, not G copies of one draw).
    tokens = np.asarray(shared.tokens).reshape(len(PROMPTS), 4, -1)
    assert any(len({tuple(r) for r in group}) > 1 for group in tokens)


def test_same_rng_same_rollout_and_new_rng_new_rollout(models):
    _, ours = models
    cfg = SamplingConfig(group_size=4, max_new_tokens=12, temperature=1.0, top_k=20, prompt_buckets=(8,))
    a = generate(ours, PROMPTS, cfg, jax.random.key(3))
    b = generate(ours, PROMPTS, cfg, jax.random.key(3))
    c = generate(ours, PROMPTS, cfg, jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_rows_stop_at_their_stop_token(models):
    _, ours = models
    M = 12
    stops = (10, 11, 12, 13, 14, 15, 16, 17)
    cfg = SamplingConfig(group_size=8, max_new_tokens=M, temperature=1.5, stop_token_ids=stops,
                         prompt_buckets=(8,), pad_token_id=0)
    out = generate(ours, PROMPTS, cfg, jax.random.key(5))
    tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
    lengths, truncated, logprobs = np.asarray(out.lengths), np.asarray(out.truncated), np.asarray(out.logprobs)
    assert 0 < truncated.sum() < len(truncated), "the case should contain both stopped and truncated rows"
    for r in range(tokens.shape[0]):
        n = lengths[r]
        np.testing.assert_array_equal(mask[r], np.arange(M) < n)
        is_stop = np.isin(tokens[r, :n], stops)
        if truncated[r]:
            assert n == M and not is_stop.any()
        else:
            assert is_stop[-1] and not is_stop[:-1].any()
        assert (tokens[r, n:] == 0).all() and (logprobs[r, n:] == 0).all()
        assert (logprobs[r, :n] < 0).all()


def test_min_new_tokens_keeps_stop_tokens_out_until_then(models):
    _, ours = models
    M, MIN = 12, 5
    stops = tuple(range(10, 40))  # so many stop tokens that most rows would stop at once
    base = SamplingConfig(group_size=8, max_new_tokens=M, temperature=1.5, stop_token_ids=stops,
                          prompt_buckets=(8,), pad_token_id=0)
    free = generate(ours, PROMPTS, base, jax.random.key(5))
    held = generate(ours, PROMPTS, SamplingConfig(**{**base.__dict__, "min_new_tokens": MIN}), jax.random.key(5))
    assert int(np.asarray(free.lengths).min()) < MIN
    lengths, tokens = np.asarray(held.lengths), np.asarray(held.tokens)
    assert lengths.min() >= MIN + 1 and not np.isin(tokens[:, :MIN], stops).any()
    # Reported log-probs are those of the untruncated distribution, as the trainer recomputes them.
    np.testing.assert_allclose(np.asarray(held.logprobs) * np.asarray(held.mask),
                               _teacher_forced_logprobs(ours, held, 1.5) * np.asarray(held.mask), atol=1e-4)
    with pytest.raises(ValueError, match="min_new_tokens must be in"):
        SamplingConfig(max_new_tokens=4, min_new_tokens=5)


def _chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "a token outside the truncated support was drawn"
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return scipy.stats.chisquare(counts[keep], expected).pvalue


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.8)])
def test_sampling_distribution_chi_square(top_k, top_p):
    logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0], np.float32)
    T, n = 0.8, 20_000
    tokens, logp = sample_tokens(jnp.tile(jnp.asarray(logits), (n, 1)), jax.random.key(7),
                                 temperature=T, top_k=top_k, top_p=top_p)
    # Independent reference: tempered softmax, then keep the top-k, then the smallest nucleus >= top_p.
    z = logits.astype(np.float64) / T
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(len(p), bool)
    keep[order[: top_k or len(p)]] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    cum = 0.0
    nucleus = np.zeros(len(p), bool)
    for i in np.argsort(-q):
        if cum >= top_p or q[i] == 0:
            break
        nucleus[i] = True
        cum += q[i]
    expected = np.where(nucleus, q, 0)
    expected /= expected.sum()
    assert _chi_square(np.asarray(tokens), expected) > 1e-3
    # Reported log-probs are those of the untruncated tempered distribution.
    np.testing.assert_allclose(np.asarray(logp), np.log(p)[np.asarray(tokens)], atol=1e-5)


def test_bad_input_fails_with_clear_errors(models):
    _, ours = models
    cfg = SamplingConfig(group_size=2, max_new_tokens=4, prompt_buckets=(8,))
    with pytest.raises(ValueError, match="largest prompt bucket 8"):
        generate(ours, [list(range(3, 12))], cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(ours, [[5], []], cfg, jax.random.key(0))
    for bad, match in [(dict(group_size=0), "group_size"), (dict(temperature=-1.0), "temperature"),
                       (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(max_new_tokens=0), "max_new")]:
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**bad)


def _rollout(R=6, N=3, M=4, P=8) -> Rollout:
    return Rollout(tokens=np.zeros((R, M), np.int32), logprobs=np.zeros((R, M), np.float32),
                   mask=np.ones((R, M), np.int32), lengths=np.full((R,), M, np.int32), truncated=np.ones((R,), bool),
                   prompt_ids=np.zeros((N, P), np.int32), prompt_mask=np.ones((N, P), np.int32))


def test_malformed_rollout_fails_naming_the_field():
    good = _rollout()
    check_rollout(good, rows=6, max_new_tokens=4)
    cases = [
        (dict(rows=8, max_new_tokens=4), {}, "Rollout.tokens"),  # wrong number of rows
        (dict(rows=6, max_new_tokens=5), {}, "Rollout.tokens"),  # wrong completion width
        ({}, dict(logprobs=np.zeros((6, 4), np.float16)), "Rollout.logprobs"),  # wrong dtype
        ({}, dict(mask=np.ones((6, 4), bool)), "Rollout.mask"),
        ({}, dict(lengths=np.zeros((5,), np.int32)), "Rollout.lengths"),
        ({}, dict(truncated=np.zeros((6,), np.int32)), "Rollout.truncated"),
        ({}, dict(prompt_ids=np.zeros((4, 8), np.int32)), "Rollout.prompt_ids"),  # 4 prompts for 6 rows
        ({}, dict(prompt_mask=np.ones((3, 7), np.int32)), "Rollout.prompt_mask"),
    ]
    # A mixture-of-experts rollout's experts: [N, P, L, Kx] and [R, M, L, Kx], integers, both or neither.
    moe = good.replace(prompt_experts=np.zeros((3, 8, 2, 2), np.uint8), experts=np.zeros((6, 4, 2, 2), np.uint8))
    check_rollout(moe, rows=6, max_new_tokens=4)

    def moe_with(**fields):  # every field of the mixture-of-experts rollout, some replaced
        return vars(moe.replace(**fields))

    cases += [
        ({}, dict(prompt_experts=moe.prompt_experts), "Rollout.prompt_experts and Rollout.experts"),  # one alone
        ({}, moe_with(experts=np.zeros((6, 5, 2, 2), np.uint8)), "Rollout.experts"),
        ({}, moe_with(experts=np.zeros((6, 4, 2), np.uint8)), "Rollout.experts"),
        ({}, moe_with(prompt_experts=np.zeros((3, 7, 2, 2), np.uint8)), "Rollout.prompt_experts"),
        ({}, moe_with(prompt_experts=np.zeros((3, 8, 2, 3), np.uint8)), "Rollout.prompt_experts"),
        ({}, moe_with(experts=np.zeros((6, 4, 2, 2), np.float32)), "Rollout.experts"),
    ]
    for kwargs, fields, name in cases:
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            check_rollout(good.replace(**fields), **{"rows": 6, "max_new_tokens": 4, **kwargs})


def test_malformed_prompt_arrays_fail_naming_the_field(models):
    _, ours = models
    cfg = SamplingConfig(group_size=2, max_new_tokens=4, prompt_buckets=(8,))
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    for prompts, name in [((ids.astype(np.float32), mask), "prompt ids"), ((ids, mask.astype(np.float32)), "prompt mask"),
                          ((ids[0], mask[0]), "prompt ids"), ((ids, mask[:, 1:]), "prompt mask")]:
        with pytest.raises(ValueError, match=name):
            generate(ours, prompts, cfg, jax.random.key(0))
    # A bool mask and int64 ids are accepted, and give the rollout of the int32 arrays.
    a = generate(ours, (ids.astype(np.int64), mask.astype(bool)), cfg, jax.random.key(0))
    b = generate(ours, (ids, mask), cfg, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
