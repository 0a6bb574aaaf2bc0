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
    # A slot the engine never fed holds one id twice: the router's own choice, no mismatch.
    filler = given.at[1].set(0)
    experts, _, fstats = moe.route(h, router, cfg, replay_XK=filler)
    np.testing.assert_array_equal(experts[1], own[1])
    np.testing.assert_array_equal(experts[0], given[0])
    assert float(fstats.mismatch) == sum(differs) - differs[1]


def test_moe_settings_that_cannot_apply_are_refused():
    """A moe section or an expert mesh axis on a dense policy, an expert axis that does not divide
    the experts, and LoRA on MLP projections a MoE model does not have: each a clear error."""
    from flax import nnx

    from grpo_jax.config import ConfigError, MeshConfig, MoEConfig, RunConfig
    from grpo_jax.models import Transformer, lora
    from grpo_jax.runtime.devices import check_moe
    from grpo_jax.tools.flops import forward_flops

    dense = tiny("qwen3")
    moe_cfg = dense.replace(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(ConfigError, match="the policy is dense"):
        check_moe(RunConfig(moe=MoEConfig(routing_replay="none")), dense)
    with pytest.raises(ConfigError, match="mesh.expert=2"):
        check_moe(RunConfig(mesh=MeshConfig(fsdp=1, expert=2)), dense)
    with pytest.raises(ConfigError, match="does not divide"):
        check_moe(RunConfig(mesh=MeshConfig(fsdp=1, expert=3)), moe_cfg)
    check_moe(RunConfig(mesh=MeshConfig(fsdp=1, expert=4), moe=MoEConfig(routing_replay="none")), moe_cfg)
    import jax

    with pytest.raises(ValueError, match="mixture-of-experts model's MLPs are experts"):
        lora.add_adapters(Transformer(moe_cfg, rngs=nnx.Rngs(0)), rank=2, alpha=4.0, key=jax.random.key(0))
    # FLOPs count the top-k experts' MLPs and the router, not intermediate_size.
    wide = moe_cfg.replace(intermediate_size=10_000)
    assert forward_flops(wide, rows=1, start=0, count=1, logits=0) == forward_flops(moe_cfg, rows=1, start=0,
                                                                                     count=1, logits=0)
    E = moe_cfg.hidden_size
    extra_expert = moe_cfg.replace(num_experts_per_tok=3)
    diff = (forward_flops(extra_expert, rows=1, start=0, count=1, logits=0)
            - forward_flops(moe_cfg, rows=1, start=0, count=1, logits=0))
    assert diff == moe_cfg.num_layers * 3 * 2 * E * 16
