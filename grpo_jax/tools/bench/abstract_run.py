"""A run's programs on abstract shapes (`abstract_run`), for `grpo-jax bench memory`.

The run is built by the code a run is built with: the policy with the run's adapters as
`nnx.eval_shape` draws it, then `trainer.construct.build_learner` (the learner, its train state, PPO's
critic, distillation's teacher, a LoRA base: what `build` calls) with `abstract=True`, and the
sampler's engine program (`engine_of`). Every array is a `jax.ShapeDtypeStruct`: nothing is
initialised, loaded or placed, so a pod-sized model compiles on a laptop's host devices.

What a run keeps on its devices between programs, per device, in parts (`AbstractRun.resident`):
`params` (the trainable parameters: the policy's, or a LoRA run's adapters), `optimizer` (the rest
of the train state: moments, counters, a PPO critic, head or model), `frozen` (a LoRA run's base),
`reference` (the KL reference's copy of the parameters: grpo.beta > 0 without LoRA), `teacher`
(distillation's), `batch_ids` (the batch's token ids and prompt mask) and `batch_rest` (its other
fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.config import ConfigError, RunConfig, SamplingConfig
from grpo_jax.learner.packing import PackRows
from grpo_jax.learner.learner import Learner
from grpo_jax.learner.objectives import objective_class
from grpo_jax.learner.train_step import Batch
from grpo_jax.models import TransformerConfig
from grpo_jax.models import load_config as load_model_config
from grpo_jax.models.moe import expert_dtype
from grpo_jax.rollout.evaluation import prompts_per_call
from grpo_jax.engine.engines import engine_of
from grpo_jax.engine.sizing import per_chip, resolve_kv_cache
from grpo_jax.runtime.sharding import batch_sharding, param_shardings, rows_per_shard
from grpo_jax.runtime.storage import is_remote
from grpo_jax.tools.bench.programs import NOT_ASKED, PROGRAMS
from grpo_jax.tools.bench.parity import preset_config
from grpo_jax.models.build import architecture, build_tokenizer
from grpo_jax.trainer.prepare import evaluation_sampling
from grpo_jax.trainer.construct import abstract_policy, build_learner

# The batch's fields that the reference pass takes (the rest stay where they are meanwhile).
_IDS = ("prompt_ids", "prompt_mask", "completion_ids")


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    # name -> (the program lowered with the run's shardings, the resident parts among its arguments)
    programs: dict[str, tuple[jax.stages.Lowered, tuple[str, ...]]]
    resident: dict[str, int]  # part (see the module docstring) -> bytes per device
    model: dict  # where the shape came from, its size and the model section's settings
    workload: dict  # the shapes the programs were lowered for
    not_compiled: dict[str, str]  # a program the run does not have -> why


def model_shape(cfg, preset: str = "") -> tuple[TransformerConfig, str]:
    """(the policy's architecture, where it came from): `preset` (bench.PRESETS), else the model
    section's architecture, else model.path's config.json (a local one: only the shape is needed)."""
    if preset:
        return preset_config(preset), f"preset {preset}"
    if cfg.path is None:
        return architecture(cfg.architecture, build_tokenizer(cfg)), "model.architecture"
    if is_remote(cfg.path):
        raise FileNotFoundError(f"model.path {cfg.path!r} is remote; bench memory needs only the model's shape: "
                                "pass --preset NAME (a known shape) or set model.path to a local copy of its config")
    return load_model_config(cfg.path), str(cfg.path)


def abstract_run(config: RunConfig, mesh, *, preset: str = "", programs: Collection[str] = (),
                 chip_bytes: int | None = None) -> AbstractRun:
    """The run's programs lowered on abstract shapes over `mesh` (see the module docstring); with
    `programs` (names of `PROGRAMS`), only those: the others the run has are in `not_compiled` as
    `NOT_ASKED` (a sampler at tens of thousands of tokens costs minutes to compile).
    `chip_bytes`: one chip's memory, which sizes `sampling.kv_cache_bytes: auto` as a run on that
    chip sizes it (grpo_jax.engine.sizing, from the resident parts); else auto is resolved for
    `mesh`'s devices (0 on CPU)."""
    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"unknown program(s) {', '.join(unknown)}: choose among {', '.join(PROGRAMS)}")
    asked = set(programs or PROGRAMS)
    model_config, source = model_shape(config.model, preset)
    model = abstract_policy(config, model_config)
    learner, state = build_learner(config, mesh, model, temperature=config.sampling.temperature, abstract=True)
    frozen = learner.frozen
    batch = abstract_batch(config, model_config)
    if learner.packing is not None:
        batch = batch.replace(packing=worst_packing(config, learner, mesh))
    resident = _resident(config, learner, state, frozen, batch, mesh)
    sampling, sized, refused = _sampling(config.sampling, model_config), None, None
    try:
        sampling, sized = resolve_kv_cache(
            config, model_config, mesh, sampling, chip=chip_bytes,
            held=lambda: (sum(v for k, v in resident.items() if not k.startswith("batch")), resident["params"]))
    except ConfigError as e:  # the run would stop at its start; its programs are still measured, without a pool
        refused = str(e)
    eval_prompts = prompts_per_call(config.eval.num_prompts, mesh)
    # name -> (lowers it, the resident parts among its arguments), for the programs this run has.
    ref_params = state.params if frozen is None else frozen
    runs = {"sampler": (lambda: _sampler(model, sampling, config.data.prompts_per_step, mesh), ("params", "frozen")),
            "eval_sampler": (lambda: _sampler(model, evaluation_sampling(sampling, config), eval_prompts, mesh),
                             ("params", "frozen"))}
    not_compiled = {}
    if config.grpo.beta > 0:
        runs["reference"] = (lambda: learner.lower_ref_logprobs(ref_params, batch),
                             ("reference" if frozen is None else "frozen", "batch_ids"))
    else:
        not_compiled["reference"] = "grpo.beta = 0: the run has no reference pass (--set grpo.beta=... to see one)"
    if learner.teacher is not None:
        runs["teacher"] = (lambda: learner.lower_teacher_logprobs(batch), ("teacher", "batch_ids"))
    runs["train_step"] = (lambda: learner.lower_step(state, batch),
                          ("params", "optimizer", "frozen", "batch_ids", "batch_rest"))
    not_compiled.update({name: NOT_ASKED for name in runs if name not in asked})
    lowered = {name: (lower(), parts) for name, (lower, parts) in runs.items() if name in asked}
    return AbstractRun(programs=lowered, resident=resident, model=_model_summary(config, model_config, source, state,
                                                                                 frozen),
                       workload={**_workload(config, mesh, eval_prompts, batch.packing),
                                 **({"kv_cache": dataclasses.asdict(sized)} if sized is not None else {}),
                                 **({"kv_cache_refused": refused} if refused else {})},
                       not_compiled=not_compiled)


def with_shardings(tree, shardings):
    """`tree`'s arrays (or jax.ShapeDtypeStructs) as jax.ShapeDtypeStructs carrying `shardings`."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def abstract_batch(config: RunConfig, model_config: TransformerConfig) -> Batch:
    """A step's Batch as jax.ShapeDtypeStructs: prompts_per_step x group_size rows, prompts padded to
    the largest bucket (the worst a step pads to), max_new_tokens completion slots; a mixture-of-experts
    policy's experts of the sampler (engine.routing: what its rollouts carry)."""
    N, G = config.data.prompts_per_step, config.sampling.group_size
    R, P, M = N * G, max(config.sampling.prompt_buckets), config.sampling.max_new_tokens

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    experts = {}
    if model_config.is_moe:
        L, K, dtype = model_config.num_layers, model_config.num_experts_per_tok, expert_dtype(model_config.num_experts)
        experts = {"prompt_experts": sds((R, P, L, K), dtype), "completion_experts": sds((R, M, L, K), dtype)}

    return Batch(prompt_ids=sds((R, P), jnp.int32), prompt_mask=sds((R, P), jnp.int32),
                 completion_ids=sds((R, M), jnp.int32), completion_mask=sds((R, M), jnp.int32),
                 rewards=sds((R,), jnp.float32), advantages=sds((R,), jnp.float32), valid=sds((R,), jnp.bool_),
                 zero_std=sds((N,), jnp.bool_), truncated=sds((R,), jnp.bool_), old_logprobs=sds((R, M), jnp.float32),
                 ref_logprobs=sds((R, M), jnp.float32) if config.grpo.beta > 0 else None,
                 teacher_logprobs=sds((R, M), jnp.float32) if objective_class(config).teacher else None, **experts)


def _resident(config: RunConfig, learner: Learner, state, frozen, batch: Batch, mesh) -> dict[str, int]:
    placed = with_shardings(state, learner.shardings)
    params = per_chip(placed.params)
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if getattr(batch, f.name) is not None}
    rows = {k: sum(per_chip(with_shardings(a, batch_sharding(mesh, a.ndim))) for a in jax.tree.leaves(v))
            for k, v in fields.items()}  # the packing plan: a few int32 per row
    return {"params": params, "optimizer": per_chip(placed) - params,
            "frozen": 0 if frozen is None else per_chip(frozen),
            "reference": params if config.grpo.beta > 0 and frozen is None else 0,
            "teacher": 0 if learner.teacher is None else per_chip(learner.teacher),
            "batch_ids": sum(v for k, v in rows.items() if k in _IDS),
            "batch_rest": sum(v for k, v in rows.items() if k not in _IDS)}


def _sampling(sampling: SamplingConfig, model_config: TransformerConfig) -> SamplingConfig:
    # Token ids change no program's memory: the model's own stop ids stand in for the tokenizer's.
    stops = tuple(sampling.stop_token_ids or model_config.eos_token_ids or (0,))
    pad = stops[0] if sampling.pad_token_id is None else sampling.pad_token_id
    return dataclasses.replace(sampling, stop_token_ids=stops, pad_token_id=pad)


def _sampler(model, sampling: SamplingConfig, prompts: int, mesh) -> jax.stages.Lowered:
    """The sampler `generate` runs (the config's engine) for `prompts` prompts in the largest bucket,
    the model placed by the rules (as `place_model` places it)."""
    graphdef, state = nnx.split(model)
    state = with_shardings(state, param_shardings(state, mesh).shardings)
    ids = jax.ShapeDtypeStruct((prompts, max(sampling.prompt_buckets)), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    with jax.set_mesh(mesh):  # a Pallas TPU kernel reads the chip from the ambient mesh when it is lowered
        return engine_of(sampling).program(graphdef, sampling, mesh).lower(state, ids, ids, key)


def _model_summary(config: RunConfig, model_config: TransformerConfig, source: str, state, frozen) -> dict:
    count = sum(x.size for x in jax.tree.leaves((state.params, frozen)))
    m = config.model
    return {"source": source, "parameters": int(count), "hidden_size": model_config.hidden_size,
            "num_layers": model_config.num_layers, "vocab_size": model_config.vocab_size, "dtype": m.dtype,
            "param_dtype": m.param_dtype, "remat": m.remat, "scan_layers": m.scan_layers, "lora_rank": config.lora.rank}


def worst_packing(config: RunConfig, learner: Learner, mesh) -> PackRows:
    """`train.packing`'s plan (as jax.ShapeDtypeStructs split over the mesh's rows) for a step whose
    every row is as long as the run allows (the largest prompt bucket, `max_new_tokens`): one row per
    bin at the default `train.pack_length`, the most bins a step's packed passes can have, so the
    packed programs at their largest."""
    N, G = config.data.prompts_per_step, config.sampling.group_size
    R, P, M = N * G, max(config.sampling.prompt_buckets), config.sampling.max_new_tokens
    plan = learner.plan(np.full(R, P), np.full(R, M))
    rows = batch_sharding(mesh, 1)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.int32, sharding=rows), plan.rows)


def _workload(config: RunConfig, mesh, eval_prompts: int, packing: PackRows | None = None) -> dict:
    N, G, micro = config.data.prompts_per_step, config.sampling.group_size, config.train.micro_batches
    packed = {} if packing is None else {"packing": {"bins_per_micro_batch": packing.bins, "bin_length": packing.length,
                                                     "shared_prompt": packing.shared}}
    return {**packed, "prompts_per_step": N, "group_size": G, "rows": N * G, "prompt_len": max(config.sampling.prompt_buckets),
            "completion_len": config.sampling.max_new_tokens, "micro_batches": micro,
            "micro_batch_rows_per_device": N * G // rows_per_shard(mesh) // micro,
            "eval_prompts_per_call": eval_prompts, "eval_k": config.eval.k}
