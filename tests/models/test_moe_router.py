"""The router of a mixture-of-experts layer against Hugging Face's: top-k weights, and the
load-balancing loss pooled over layers and real tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import moe
from grpo_jax.models.presets import tiny

torch = pytest.importorskip("torch")


def test_aux_loss_and_weights_equal_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    cfg = tiny("qwen3").replace(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    rng = np.random.default_rng(0)
    X, E = 12, cfg.hidden_size
    mask = np.ones((2, 6), np.int64)
    mask[0, :2] = 0
    layers = []
    for _ in range(3):
        h, router = rng.normal(size=(X, E)).astype(np.float32), rng.normal(size=(E, 8)).astype(np.float32)
        experts, weights, stats = moe.route(jnp.asarray(h), jnp.asarray(router), cfg,
                                            real_X=jnp.asarray(mask.reshape(-1) > 0))
        logits = torch.from_numpy(h @ router)
        probs = torch.softmax(logits, -1)
        top, idx = torch.topk(probs, 2, -1)
        np.testing.assert_array_equal(np.asarray(experts), idx.numpy())
        np.testing.assert_allclose(np.asarray(weights), (top / top.sum(-1, keepdim=True)).numpy(), atol=1e-6)
        layers.append((logits, stats))
    ours = moe.aux_loss(moe.Routing(experts=None, **{k: jnp.stack([getattr(s, k) for _, s in layers]) for k in
                                                      ("counts", "prob_sums", "tokens", "mismatch")}))
    theirs = load_balancing_loss_func(tuple(l for l, _ in layers), 8, 2, torch.from_numpy(mask))
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-5)


def test_replay_takes_the_given_experts_and_counts_the_routers_disagreement():
    cfg = tiny("qwen3").replace(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    rng = np.random.default_rng(1)
    h, router = jnp.asarray(rng.normal(size=(5, cfg.hidden_size)), jnp.float32), jnp.asarray(
        rng.normal(size=(cfg.hidden_size, 4)), jnp.float32)
    own, _, _ = moe.route(h, router, cfg)
    given = jnp.asarray([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], jnp.int32)
    experts, weights, stats = moe.route(h, router, cfg, replay_XK=given)
    np.testing.assert_array_equal(experts, given)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    differs = [set(map(int, a)) != set(map(int, b)) for a, b in zip(own, given)]
    assert float(stats.mismatch) == sum(differs)
    compared, _, cstats = moe.route(h, router, cfg, replay_XK=given, follow=False)
    np.testing.assert_array_equal(compared, own)
    assert float(cstats.mismatch) == sum(differs)
