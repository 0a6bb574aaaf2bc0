"""One construction of a run's learner, shared by the run (`trainer.setup.build`), its start's
KV-cache sizing (`held_bytes`: what the run holds per chip, on abstract shapes) and `grpo-jax bench
memory` / `grpo-jax plan` (grpo_jax.tools.bench.abstract_run): the run's adapters, the learner and
its fresh train state, on real or abstract shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config import RunConfig
from grpo_jax.engine.sizing import per_chip
from grpo_jax.learner.learner import Learner
from grpo_jax.learner.modes import make_learner
from grpo_jax.learner.objectives import objective_class
from grpo_jax.learner.optimizer import run_optimizer
from grpo_jax.learner.step_factory import TrainState, new_state
from grpo_jax.learner.train_step import split_trainable
from grpo_jax.models import Transformer
from grpo_jax.models.build import model_options
from grpo_jax.models.lora import add_adapters, strip_adapters
from grpo_jax.runtime.sharding import placed_shapes
from grpo_jax.trainer.side_models import build_critic, load_teacher


def add_run_adapters(model: Transformer, config: RunConfig) -> None:
    """The run's LoRA adapters (`lora.rank` > 0), drawn from the seed; nothing without."""
    lo = config.lora
    if lo.enabled:
        add_adapters(model, rank=lo.rank, alpha=lo.alpha, targets=lo.targets, dropout=lo.dropout,
                     key=jax.random.fold_in(jax.random.key(config.train.seed), 16))


def build_learner(cfg: RunConfig, mesh, model, *, temperature: float,
                  abstract: bool = False) -> tuple[Learner, TrainState]:
    """The learner around `model` (the policy with the run's adapters) and its fresh train state,
    not yet placed: the optimizer, PPO's critic, distillation's teacher, a LoRA run's frozen base,
    the KL reference. `abstract`: `model` holds jax.ShapeDtypeStructs (`nnx.eval_shape`) and so
    does everything built here, nothing loaded, drawn or placed (`grpo-jax bench memory` lowers
    the run's programs on them); the learner is the one a run gets, but it holds no reference copy
    (the programs take theirs as arguments)."""
    optimizer = run_optimizer(cfg)
    critic_graphdef, critic = None, None
    algorithm = objective_class(cfg)
    if algorithm.critic:  # after the warm start: a critic copied from the policy copies the warm-started one
        critic_graphdef, critic = build_critic(cfg, model, mesh, model_options(cfg.model), abstract=abstract)
    graphdef, params, frozen = split_trainable(model)
    fresh = functools.partial(new_state, optimizer=optimizer)
    if abstract:
        state = jax.eval_shape(lambda p, c: fresh(p, critic=c), params, critic)
    else:
        state = fresh(params, critic=critic)
    if abstract and frozen is not None:  # placed with the model, by the rules
        frozen = placed_shapes(frozen, mesh)
    # The KL reference (beta > 0): a copy of the params, saved with each checkpoint; a LoRA run's
    # is its frozen base in the structure without adapters (no copy; the base is on disk, lora_base).
    ref_graphdef = None if frozen is None else nnx.split(strip_adapters(model), nnx.Param)[0]
    teacher = load_teacher(cfg, mesh, model_options(cfg.model), abstract=abstract) if algorithm.teacher else None
    reference = None
    if cfg.grpo.beta > 0 and frozen is None and not abstract:
        reference = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    learner = make_learner(cfg, mesh, graphdef, optimizer, state, temperature=temperature, frozen=frozen,
                           ref_graphdef=ref_graphdef, critic_graphdef=critic_graphdef, teacher=teacher,
                           reference=reference, model_config=model.config)
    return learner, state


def abstract_policy(cfg: RunConfig, model_config) -> Transformer:
    """The run's policy (with its adapters) as `nnx.eval_shape` draws it: shapes, nothing allocated."""
    def policy():
        model = Transformer(model_config, rngs=nnx.Rngs(cfg.train.seed), **model_options(cfg.model))
        add_run_adapters(model, cfg)
        return model

    return nnx.eval_shape(policy)


def held_bytes(cfg: RunConfig, model_config, mesh, *, samples_apart: bool = False) -> tuple[int, int]:
    """(Bytes per chip the run keeps on `mesh` while it samples, of which trainable parameters):
    the train state, a LoRA base, the KL reference's copy, a teacher, by the shardings the run
    gives them (`build_learner` on abstract shapes). `samples_apart`: the chips of a sampler mesh
    of its own, which hold a replicated copy of the policy's weights only."""
    model = abstract_policy(cfg, model_config)
    if samples_apart:
        weights = per_chip(nnx.state(model, nnx.Param))
        return weights, weights
    learner, state = build_learner(cfg, mesh, model, temperature=cfg.sampling.temperature, abstract=True)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, learner.shardings)
    total, params = per_chip(placed), per_chip(placed.params)
    if learner.frozen is not None:
        total += per_chip(learner.frozen)
    elif cfg.grpo.beta > 0:
        total += params  # the reference's copy, placed as the parameters
    if learner.teacher is not None:
        total += per_chip(learner.teacher)
    return total, params
