"""Issue 30: VAPO's critic and on-policy distillation in the train step. Value warm-up moves the
critic alone (its loss falls, its explained variance rises, the policy and its optimizer state do
not move); the positive-example LM loss and distillation's per-token advantages against NumPy; a
separate critic model sharded on a (2, 2, 2) mesh equals one device (micro-batched equals the
whole batch: tests/learner/test_ppo.py); a teacher equal to the student gives zero advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.config import DistillConfig, GRPOConfig, MeshConfig, OptimizerConfig, PPOConfig
from grpo_jax.learner.grpo import group_advantages
from grpo_jax.learner.optimizer import make_optimizer, pair_optimizer
from grpo_jax.learner.train_step import init_state, make_train_step
from grpo_jax.runtime.sharding import make_mesh, place_train_state
from batches import long_batch, make_batch, one_device_ref_step, one_device_step, policy, ppo_state, step_spec

REWARDS = [1, 0, 0, 1, 0, 1, 1, 0]


def copy(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


@pytest.mark.parametrize("kind", ["head", "model"])
def test_value_warmup_trains_the_critic_alone(kind):
    opt = pair_optimizer(make_optimizer(OptimizerConfig(learning_rate=1e-3)),
                         make_optimizer(OptimizerConfig(learning_rate=1e-2)))
    graphdef, state, critic_graphdef = ppo_state(opt, kind)
    params0, policy_opt0, critic0 = copy(state.params), copy(state.opt_state.inner_states["policy"]), copy(state.critic)
    warmup = 25
    step = one_device_step(graphdef, opt, GRPOConfig(), state, critic_graphdef=critic_graphdef,
                           ppo_config=PPOConfig(value_warmup_steps=warmup, lam_critic=0.5, positive_lm_coef=0.1,
                                                critic=kind))
    batch = make_batch(rewards=REWARDS)  # one fixed rollout set
    history = []
    for _ in range(warmup):
        state, m = step(state, batch)
        history.append({k: float(v) for k, v in m.items()})
    assert all(h["value/warmup"] == 1.0 for h in history)
    # The policy and its half of the optimizer state are bit for bit where they started...
    for a, b in zip(jax.tree.leaves(params0), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    for a, b in zip(jax.tree.leaves(policy_opt0), jax.tree.leaves(state.opt_state.inner_states["policy"])):
        np.testing.assert_array_equal(a, np.asarray(b))
    # ... while the critic learns the Monte-Carlo returns (lambda 1, not lam_critic's 0.5).
    assert any(np.abs(a - np.asarray(b)).max() > 1e-4 for a, b in
               zip(jax.tree.leaves(critic0), jax.tree.leaves(state.critic)))
    losses, ev = [h["value/loss"] for h in history], [h["value/explained_variance"] for h in history]
    assert losses[-1] < 0.5 * losses[0], losses
    assert ev[-1] > ev[0] + 0.3 and ev[-1] > 0.3, ev
    # The first step after the warm-up moves the policy.
    state, m = step(state, batch)
    assert float(m["value/warmup"]) == 0.0
    assert any(np.abs(a - np.asarray(b)).max() > 1e-6 for a, b in
               zip(jax.tree.leaves(params0), jax.tree.leaves(state.params)))


def test_positive_example_lm_loss_against_numpy():
    """The loss with positive_lm_coef c is the loss without plus c x the mean negative log-prob of
    the tokens of rows with a reward > 0 (a dropped row's, NaN, is not one)."""
    rewards = np.array([1, 0, 0, 0.5, np.nan, 1, -1, 0], np.float32)
    batch = make_batch(rewards=rewards)
    model = policy()
    graphdef, params = nnx.split(model, nnx.Param)
    ref = one_device_ref_step(graphdef, params)
    logp = np.asarray(ref(params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids))
    mask = np.asarray(batch.completion_mask, np.float64)
    positive = (np.nan_to_num(rewards) > 0) & ~np.isnan(rewards)
    want = -np.sum(logp * mask * positive[:, None]) / np.sum(mask * positive[:, None])
    out = {}
    for coef in (0.0, 0.3):
        opt = pair_optimizer(optax.sgd(0.0), optax.sgd(0.0))
        g, state, _ = ppo_state(opt, "head")
        step = one_device_step(g, opt, GRPOConfig(), state, ppo_config=PPOConfig(positive_lm_coef=coef))
        out[coef] = {k: float(v) for k, v in step(state, batch)[1].items()}
    assert out[0.3]["train/positive_lm_loss"] == pytest.approx(want, rel=1e-5)
    assert out[0.3]["train/loss"] - out[0.0]["train/loss"] == pytest.approx(0.3 * want, rel=1e-4)


def mesh_batch():
    """16 rows, 4 prompts: the prompts split over the (2, 2, 2) mesh's 4 row shards."""
    batch = long_batch(rows=16, completion_len=12)
    rewards = jnp.asarray(np.random.default_rng(1).integers(0, 2, 16), jnp.float32)
    adv = group_advantages(rewards, 4)
    return batch.replace(rewards=rewards, advantages=adv.advantages, valid=adv.valid, zero_std=adv.zero_std)


def _critic_model_step(shape):
    devices = jax.devices()[:int(np.prod(shape))]
    mesh = make_mesh(MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2]), devices)
    opt = pair_optimizer(optax.sgd(0.5, momentum=0.9), optax.sgd(0.5, momentum=0.9))
    graphdef, state, critic_graphdef = ppo_state(opt, "model")
    state, shardings, left_whole = place_train_state(state, mesh)
    assert left_whole == []
    spec = step_spec(graphdef, opt, GRPOConfig(), micro_batches=2, critic_graphdef=critic_graphdef,
                     ppo_config=PPOConfig(critic="model"))
    step = make_train_step(spec, mesh=mesh, state_shardings=shardings)
    batch = mesh_batch()
    for _ in range(2):  # the second step reads the momentum of the first
        state, metrics = step(state, batch)
    return state, {k: float(v) for k, v in metrics.items()}


def test_a_critic_model_sharded_on_a_mesh_equals_one_device():
    one, m_one = _critic_model_step((1, 1, 1))
    cube, m_cube = _critic_model_step((2, 2, 2))
    # The critic's transformer is cut by the policy's rules (its embedding over tensor x fsdp) and
    # its momentum like it; the head stays whole.
    embed = cube.critic["model"]["embed"].get_value()
    assert not embed.sharding.is_fully_replicated
    moments = [x for x in jax.tree.leaves(cube.opt_state.inner_states["critic"],
                                          is_leaf=lambda x: isinstance(x, nnx.State))
               if isinstance(x, nnx.State) and jax.tree.leaves(x)]  # not the policy's masked half
    assert moments and moments[0]["embed"].get_value().sharding.is_equivalent_to(embed.sharding, 2)
    for a, b in zip(jax.tree.leaves((one.params, one.critic)), jax.tree.leaves((cube.params, cube.critic))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for key in ("train/loss", "value/loss", "value/explained_variance"):
        assert m_cube[key] == pytest.approx(m_one[key], abs=1e-5), key


def _distill_step(state, graphdef, opt, batch, config, micro_batches=1):
    step = one_device_step(graphdef, opt, GRPOConfig(), state, micro_batches=micro_batches, distill_config=config)
    state, metrics = step(state, batch)
    return state, {k: float(v) for k, v in metrics.items()}


def test_distillation_objective_against_numpy():
    """At mu = 1 the clipped surrogate's value is -mean(A_t) over the loss tokens, with A_t =
    coef x (teacher - student log-prob) + reward_coef x the row's group advantage."""
    rng = np.random.default_rng(3)
    batch = make_batch(rewards=REWARDS)
    teacher = rng.normal(-4.0, 1.0, batch.completion_ids.shape).astype(np.float32)
    batch = batch.replace(teacher_logprobs=jnp.asarray(teacher))
    graphdef, params = nnx.split(policy(), nnx.Param)
    student = np.asarray(one_device_ref_step(graphdef, params)(params, batch.prompt_ids, batch.prompt_mask,
                                                                 batch.completion_ids), np.float64)
    mask = np.asarray(batch.completion_mask, np.float64) * np.asarray(batch.valid)[:, None]
    config = DistillConfig(teacher="unused", coef=0.7, reward_coef=0.5)
    adv = 0.7 * (teacher - student) + 0.5 * np.asarray(batch.advantages)[:, None]
    opt = optax.sgd(1.0)
    results = []
    for k in (1, 2):
        graphdef, state = init_state(policy(), opt)
        results.append(_distill_step(state, graphdef, opt, batch, config, micro_batches=k))
    (s1, m1), (s2, m2) = results
    assert m1["train/loss"] == pytest.approx(-np.sum(adv * mask) / mask.sum(), rel=1e-5)
    assert m1["distill/reverse_kl"] == pytest.approx(np.sum((student - teacher) * mask) / mask.sum(), rel=1e-5)
    assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-6)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)


def test_a_teacher_equal_to_the_student_gives_zero_advantages():
    batch = make_batch(rewards=REWARDS)
    opt = optax.sgd(1.0)
    graphdef, state = init_state(policy(), opt)
    params0 = copy(state.params)
    same = one_device_ref_step(graphdef, state.params)(state.params, batch.prompt_ids, batch.prompt_mask,
                                                        batch.completion_ids)
    state, m = _distill_step(state, graphdef, opt, batch.replace(teacher_logprobs=same), DistillConfig(teacher="x"))
    assert abs(m["distill/reverse_kl"]) < 1e-6 and abs(m["train/loss"]) < 1e-6
    assert m["train/grad_norm"] < 1e-5
    for a, b in zip(jax.tree.leaves(params0), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(a, np.asarray(b), atol=1e-6)


def test_a_critic_models_trunk_and_head_take_their_own_learning_rates():
    """ppo.critic_trunk_learning_rate moves the critic's transformer; ppo.critic_learning_rate its
    head (AdamW's first step moves every parameter by about its learning rate)."""
    from runs import CONFIG

    from grpo_jax.config import config_from_dict
    from grpo_jax.learner.optimizer import run_optimizer

    ppo = {"critic": "model", "critic_learning_rate": 0.5, "critic_trunk_learning_rate": 1e-7}
    config = config_from_dict({**CONFIG, "algorithm": "ppo", "ppo": ppo,
                               "train": {**CONFIG["train"], "learning_rate": 1e-7, "warmup_steps": 0}})
    opt = run_optimizer(config)
    graphdef, state, critic_graphdef = ppo_state(opt, "model")
    before = copy(state.critic)
    step = one_device_step(graphdef, opt, GRPOConfig(), state, critic_graphdef=critic_graphdef, ppo_config=config.ppo)
    state, _ = step(state, make_batch(rewards=REWARDS))
    moved = {k: max(float(np.abs(a - np.asarray(b)).max()) for a, b in
                    zip(jax.tree.leaves(before[k]), jax.tree.leaves(state.critic[k]))) for k in before}
    assert 0.4 < moved["w"] <= 0.51 and 0.4 < moved["b"] <= 0.51, moved
    assert 0 < moved["model"] <= 2.5e-7, moved  # 1e-7 and float32 rounding of weights near 1
