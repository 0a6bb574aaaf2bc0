"""A random GRPO batch and a fresh train state of the tiny qwen3 preset, shared by the learner's
and the health tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.learner.grpo import group_advantages
from grpo_jax.learner.train_step import Batch, init_state
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny

R, P, M, G = 8, 6, 5, 4


def make_batch(seed=0, rewards=None):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 256, (R, P)).astype(np.int32)
    pmask = np.ones_like(prompt)
    pmask[::3, :2] = 0
    comp = rng.integers(3, 256, (R, M)).astype(np.int32)
    cmask = (np.arange(M)[None] < rng.integers(1, M + 1, R)[:, None]).astype(np.int32)
    rewards = rng.integers(0, 2, R).astype(np.float32) if rewards is None else np.asarray(rewards, np.float32)
    adv = group_advantages(jnp.asarray(rewards), G)
    return Batch(prompt_ids=jnp.asarray(prompt), prompt_mask=jnp.asarray(pmask), completion_ids=jnp.asarray(comp),
                 completion_mask=jnp.asarray(cmask), rewards=jnp.asarray(rewards), advantages=adv.advantages,
                 valid=adv.valid, zero_std=adv.zero_std, truncated=jnp.asarray(cmask.sum(1) == M),
                 old_logprobs=jnp.asarray(rng.normal(-3, 0.1, (R, M)), jnp.float32))


def long_batch(rows=8, seed=0, prompt_len=8, completion_len=56, group_size=4):
    """A batch of 64-token rows (8 prompt, 56 completion) in groups of 4: long enough that each
    layer's activations are most of what a train step keeps (the tests of compiled memory)."""
    rng = np.random.default_rng(seed)
    R, P, M = rows, prompt_len, completion_len
    cmask = (np.arange(M)[None] < rng.integers(M // 2, M + 1, R)[:, None]).astype(np.int32)
    adv = group_advantages(jnp.asarray(rng.integers(0, 2, R), jnp.float32), group_size)
    return Batch(prompt_ids=jnp.asarray(rng.integers(3, 256, (R, P)), jnp.int32), prompt_mask=jnp.ones((R, P), jnp.int32),
                 completion_ids=jnp.asarray(rng.integers(3, 256, (R, M)), jnp.int32),
                 completion_mask=jnp.asarray(cmask), rewards=jnp.zeros((R,), jnp.float32), advantages=adv.advantages,
                 valid=adv.valid, zero_std=adv.zero_std, truncated=jnp.asarray(cmask.sum(1) == M),
                 old_logprobs=jnp.full((R, M), -3.0, jnp.float32))


def fresh(optimizer, seed=0):
    return init_state(Transformer(tiny("qwen3"), rngs=nnx.Rngs(seed)), optimizer)


def one_device_mesh():
    """The mesh of the first device: where the learner's steps run in tests of one device."""
    import jax

    from grpo_jax.config import MeshConfig
    from grpo_jax.runtime.sharding import make_mesh

    return make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])


def step_spec(graphdef, optimizer, config, *, ppo_config=None, distill_config=None, critic_graphdef=None,
              moe_config=None, **kw):
    """A `StepSpec` with the objective these sections make (as `objectives.make_objective` makes a
    run's from its config); `kw`: the spec's other fields (micro_batches, group_size, ...)."""
    from grpo_jax.config import MoEConfig
    from grpo_jax.learner.objectives import DistillObjective, GRPOObjective, PPOObjective
    from grpo_jax.learner.train_step import StepSpec

    moe = moe_config or MoEConfig()
    common = dict(replay=moe.routing_replay == "sampler", aux_loss_coef=moe.aux_loss_coef)
    if ppo_config is not None:
        objective = PPOObjective(ppo=ppo_config, critic_graphdef=critic_graphdef, **common)
    elif distill_config is not None:
        objective = DistillObjective(distill=distill_config, **common)
    else:
        objective = GRPOObjective(**common)
    return StepSpec(graphdef=graphdef, optimizer=optimizer, config=config, objective=objective, **kw)


def one_device_step(graphdef, optimizer, config, state, *, frozen=None, **kw):
    """`make_train_step` on `one_device_mesh()` for `state` (and a LoRA run's `frozen` base); `kw`:
    `step_spec`'s."""
    from grpo_jax.learner.train_step import make_train_step
    from grpo_jax.runtime.sharding import place_train_state, replicated

    mesh = one_device_mesh()
    _, shardings, _ = place_train_state(state, mesh)
    frozen_shardings = None if frozen is None else replicated(mesh)  # one device: a prefix for the whole tree
    return make_train_step(step_spec(graphdef, optimizer, config, **kw), mesh=mesh, state_shardings=shardings,
                           frozen_shardings=frozen_shardings)


def one_device_ref_step(graphdef, params, **kw):
    """`make_ref_logprobs_step` on `one_device_mesh()` for reference `params`."""
    from grpo_jax.learner.train_step import make_ref_logprobs_step
    from grpo_jax.runtime.sharding import replicated

    mesh = one_device_mesh()
    return make_ref_logprobs_step(graphdef, mesh=mesh, params_shardings=replicated(mesh), **kw)


def policy(seed=0):
    """A tiny policy whose every sharded dimension divides the (2, 2, 2) mesh's axes."""
    return Transformer(tiny("qwen3", hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2),
                       rngs=nnx.Rngs(seed))


def ppo_state(optimizer, kind: str = "head", seed=0, model=None):
    """(graphdef, PPO state, the critic model's graphdef or None) for `model` (default `policy(seed)`)
    with a `kind` critic: "head" (a random head on the policy's trunk) or "model" (a separate
    transformer of another seed, with the head)."""
    from grpo_jax.learner.ppo import init_critic

    model = policy(seed) if model is None else model
    head = init_critic(model.config.hidden_size)
    head["w"] = jnp.asarray(np.random.default_rng(seed).normal(0, 0.1, head["w"].shape), jnp.float32)
    critic_graphdef = None
    if kind == "model":
        critic_graphdef, trunk = nnx.split(policy(seed + 1), nnx.Param)
        head = {**head, "model": trunk}
    graphdef, state = init_state(model, optimizer, critic=head)
    return graphdef, state, critic_graphdef
