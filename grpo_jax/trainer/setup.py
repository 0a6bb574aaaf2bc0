"""A run's pieces, built in order from its prepared inputs (`build`): the policy (loaded or
initialised, placed on the mesh, warm-started), a LoRA run's base and adapters, the train state,
the parallelism and the learner around it, and the rollout source that samples with the policy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from grpo_jax.learner.learner import Learner
from grpo_jax.trainer.warm_start import warm_start
from grpo_jax.learner.step_factory import TrainState
from grpo_jax.rewards import StatefulReward
from grpo_jax.rollout.episode_source import EpisodeSampler
from grpo_jax.rollout.pipeline import PipelinedSource
from grpo_jax.rollout.source import SyncSampler
from grpo_jax.runtime.sharding import place_model
from grpo_jax.trainer import lora_base
from grpo_jax.models.build import build_model
from grpo_jax.trainer.construct import add_run_adapters, build_learner
from grpo_jax.trainer.prepare import Prepared


@dataclasses.dataclass(frozen=True)
class Built:
    learner: Learner
    state: TrainState  # placed where the learner's update wants it, fresh (a resumed run restores into it)
    source: SyncSampler | PipelinedSource  # `source.model`: the policy the sampler (and evaluation) reads
    base: dict | None  # a LoRA run's base record (grpo_jax.trainer.lora_base), in checkpoint metadata
    teacher: Callable | None = None  # distillation: the teacher's scorer at evaluation's k and temperature


def stateful_rewards(prepared: Prepared) -> list[StatefulReward]:
    """Every reward the run scores with that holds something (a reward model), once each."""
    specs = [*prepared.rollout.rewards, *prepared.eval.judges()]
    return list({id(s.fn): s.fn for s in specs if isinstance(s.fn, StatefulReward)}.values())


def build(prepared: Prepared, *, run_dir: Path, saved_base: dict | None, resuming: bool,
          log: Callable[[str], None]) -> Built:
    """The run's pieces. `resuming`: the params will come from a checkpoint (no warm start);
    `saved_base`: that checkpoint's LoRA base record."""
    cfg, mesh = prepared.config, prepared.mesh
    # A loaded policy goes from host memory straight onto the mesh; an initialised one is drawn the
    # same in every host's memory (init_on_host) and cut onto the mesh by the rules (pmap mode: its
    # data-only mesh, so replicated). Neither sits whole on a chip or gathers anything across hosts.
    model = build_model(cfg.model, prepared.model.config, cfg.train.seed, mesh)
    place_model(model, mesh)
    for reward in stateful_rewards(prepared):  # a reward model: on the run's mesh, by the policy's rules
        reward.place(mesh)
    if cfg.sft.steps and not resuming:
        t0 = time.perf_counter()
        losses = warm_start(prepared, model, log)
        log(f"warm start: {cfg.sft.steps} steps in {time.perf_counter() - t0:.1f} s, "
            f"loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}")
    base = lora_base.settle(cfg, model, mesh=mesh, run_dir=run_dir, saved=saved_base) if cfg.lora.enabled else None
    add_run_adapters(model, cfg)  # after the warm start: a LoRA run adapts the warm-started base
    place_model(model, mesh)  # the adapters too
    learner, state = build_learner(cfg, mesh, model, temperature=prepared.rollout.sampling.temperature)
    state = learner.place(state)
    for line in learner.not_sharded:
        log(f"not sharded (its mesh axis does not divide it): {line}")
    t = cfg.train
    options = dict(seed=t.seed, shared_prompt=t.shared_prompt, dynamic_sampling=t.dynamic_sampling,
                   max_resample_rounds=t.max_resample_rounds, reward_control=cfg.reward_control)
    if prepared.rollout.episodes is None:
        source = SyncSampler(prepared.rollout, model, **options)
    else:
        source = EpisodeSampler(prepared.rollout, model, log=log, **options)
    if cfg.rollout.pipelined:  # staleness, or the sampler on its own devices
        source = PipelinedSource(source, staleness=cfg.rollout.staleness, last_step=cfg.train.steps,
                                 sampler_mesh=prepared.rollout.sampler_mesh)
    ev = prepared.eval.sampling
    return Built(learner=learner, state=state, source=source, base=base,
                 teacher=learner.teacher_scorer(group_size=ev.group_size, temperature=ev.temperature))
