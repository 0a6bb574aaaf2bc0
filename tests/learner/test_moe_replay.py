"""Mixture-of-experts in the learner: routing replay makes the learner score what the sampler drew,
the routing-mismatch metric says how often the learner's router would differ, and the
load-balancing loss reaches the gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.config import GRPOConfig, MoEConfig
from grpo_jax.learner.logprobs import completion_logprobs, completion_states
from grpo_jax.learner.train_step import train_step
from grpo_jax.models import Transformer
from grpo_jax.models import moe
from grpo_jax.models.presets import tiny
from tests.batches import G, fresh, make_batch, step_spec

M = 6


def moe_model(k: int, seed: int = 0) -> Transformer:
    cfg = tiny("qwen3").replace(family="qwen3_moe", num_experts=8, num_experts_per_tok=k, moe_intermediate_size=32,
                                router_aux_loss_coef=0.0)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    # A router with weights large enough that tokens spread over the experts decisively.
    model.layers.router[...] = model.layers.router[...] * 20.0
    return model


def sample(model: Transformer, prompt: jax.Array, group: int):
    """A greedy lock-step sampler over the model's own prefill and decode steps, recording experts:
    (tokens [R, M], log-probs [R, M], prompt experts [R, P, L, Kx], completion experts [R, M, L, Kx])."""
    logits, cache, prompt_experts = model.prefill(prompt, decode_steps=M - 1, group_size=group, last_only=True,
                                                  with_routing=True)
    logits = jnp.repeat(logits[:, -1], group, axis=0)
    rng = np.random.default_rng(0)
    tokens, logps, experts = [], [], []
    for t in range(M):
        # A per-row token from the top 3 (a sampler's diversity, deterministically).
        pick = jnp.argsort(-logits, axis=-1)[jnp.arange(logits.shape[0]), rng.integers(0, 3, logits.shape[0])]
        tokens.append(pick)
        logps.append(jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), pick])
        if t < M - 1:
            logits, cache, e = model.decode_step(pick, cache, with_routing=True)
            experts.append(e)
    experts.append(jnp.zeros_like(experts[0]))  # the last token is never fed
    return (jnp.stack(tokens, 1), jnp.stack(logps, 1), jnp.repeat(prompt_experts, group, axis=0),
            jnp.stack(experts, 1))


@pytest.fixture(scope="module")
def prompt():
    return jnp.asarray(np.random.default_rng(1).integers(3, 256, (2, 5)), jnp.int32)


@pytest.mark.parametrize("group_size", [1, 2])
def test_replay_scores_what_the_sampler_drew_after_the_router_changed(prompt, group_size):
    """Top-1 routing with normalised weights: a token's MLP is its expert's alone, so with the
    sampler's experts replayed the learner's log-probs equal the sampler's even after the router's
    weights changed; without replay the changed router sends tokens elsewhere, and the mismatch
    metric counts them."""
    model = moe_model(k=1)
    tokens, logps, p_exp, c_exp = sample(model, prompt, group=2)
    pmask = jnp.ones((tokens.shape[0], prompt.shape[1]), jnp.int32)
    prompts = jnp.repeat(prompt, 2, axis=0)
    kw = dict(group_size=group_size, experts=(p_exp, c_exp))
    same, _ = completion_logprobs(model, prompts, pmask, tokens, **kw)
    np.testing.assert_allclose(same, logps, atol=1e-5)
    model.layers.router[...] = model.layers.router[...] + jax.random.normal(jax.random.key(7),
                                                                            model.layers.router.shape) * 40.0
    replayed, _ = completion_logprobs(model, prompts, pmask, tokens, **kw)
    np.testing.assert_allclose(replayed, logps, atol=1e-5)
    free, _ = completion_logprobs(model, prompts, pmask, tokens, replay=False, **kw)
    assert float(jnp.abs(free - logps).max()) > 1e-2
    _, routed = completion_states(model, prompts, pmask, tokens, replay=False, with_routing=True, **kw)
    mismatch = float(moe.metrics(routed)["moe/routing_mismatch"])
    assert 0.2 < mismatch <= 1.0
    _, followed = completion_states(model, prompts, pmask, tokens, with_routing=True, **kw)
    # Replay follows the sampler's experts, and reports how often the router would not have.
    assert float(moe.metrics(followed)["moe/routing_mismatch"]) == pytest.approx(mismatch)


def test_top2_replay_equals_sampler_and_uses_its_experts(prompt):
    """Top-2: the learner's pass (one shared prompt per group) with replay gives the sampler's
    log-probs, and each scored token goes to the experts the sampler recorded."""
    model = moe_model(k=2)
    tokens, logps, p_exp, c_exp = sample(model, prompt, group=2)
    pmask = jnp.ones((tokens.shape[0], prompt.shape[1]), jnp.int32)
    prompts = jnp.repeat(prompt, 2, axis=0)
    h, routed = completion_states(model, prompts, pmask, tokens, group_size=2, experts=(p_exp, c_exp),
                                  with_routing=True)
    logp, _ = completion_logprobs(model, prompts, pmask, tokens, group_size=2, experts=(p_exp, c_exp))
    np.testing.assert_allclose(logp, logps, atol=1e-5)
    np.testing.assert_array_equal(routed.experts[:, :M - 1], c_exp[:, :M - 1])
    assert float(moe.metrics(routed)["moe/routing_mismatch"]) == 0.0


def _moe_batch(model, k_layers, seed=0):
    batch = make_batch(seed=seed, rewards=[1.0] * 8)  # uniform groups: every advantage is 0
    R, P = batch.prompt_ids.shape
    M_ = batch.completion_ids.shape[1]
    rng = np.random.default_rng(seed)
    L, K = model.config.num_layers, model.config.num_experts_per_tok
    experts = lambda T: jnp.asarray(rng.integers(0, model.config.num_experts, (R, T, L, K)), jnp.uint8)  # noqa: E731
    return batch.replace(prompt_experts=experts(P), completion_experts=experts(M_))


@pytest.mark.parametrize("replay", ["sampler", "none"])
def test_aux_loss_and_its_coefficient_reach_the_gradient(replay):
    """Every advantage 0 and no KL term: the policy loss has no gradient, so the router moves only
    through the load-balancing loss, and only when its coefficient is above 0."""
    model = moe_model(k=2)
    opt = optax.sgd(1.0)
    graphdef, state = fresh_moe(model, opt)
    batch = _moe_batch(model, 2)
    moved = {}
    for coef in (0.0, 0.5):
        spec = step_spec(graphdef, opt, GRPOConfig(beta=0.0), group_size=G,
                         moe_config=MoEConfig(routing_replay=replay, aux_loss_coef=coef))
        new, metrics = train_step(state, batch, spec=spec)
        moved[coef] = float(jnp.abs(new.params["layers"]["router"][...] - state.params["layers"]["router"][...]).max())
        assert float(metrics["moe/aux_loss"]) > 1.0  # top-2 over 8 experts: >= 2 when balanced... >= k * 1
        assert 1.0 <= float(metrics["moe/expert_load_max"]) <= 8.0
        assert 0.0 <= float(metrics["moe/routing_mismatch"]) <= 1.0
    assert moved[0.0] == 0.0
    assert moved[0.5] > 1e-6


def fresh_moe(model, opt):
    from grpo_jax.learner.train_step import init_state

    return init_state(model, opt)


def test_moe_metrics_say_only_what_was_measured():
    """A dense step has no moe/* metrics; a MoE batch without the sampler's experts has the
    routers' load figures but no mismatch figure (nothing to compare with)."""
    opt = optax.sgd(0.1)
    graphdef, state = fresh(opt)
    _, metrics = train_step(state, make_batch(), spec=step_spec(graphdef, opt, GRPOConfig(), group_size=G))
    assert not any(k.startswith("moe/") for k in metrics)
    graphdef, state = fresh_moe(moe_model(k=2), opt)
    with pytest.raises(ValueError, match="needs the sampler's experts"):
        train_step(state, make_batch(), spec=step_spec(graphdef, opt, GRPOConfig(), group_size=G))
    _, metrics = train_step(state, make_batch(), spec=step_spec(graphdef, opt, GRPOConfig(), group_size=G,
                                                   moe_config=MoEConfig(routing_replay="none")))
    assert {"moe/aux_loss", "moe/expert_load_max"} <= set(metrics) and "moe/routing_mismatch" not in metrics
