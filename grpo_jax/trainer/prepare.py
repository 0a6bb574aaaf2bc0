"""From a RunConfig to the objects a run needs: tokenizer, policy, reward functions, prompt streams.

Everything that can fail because of the user's input (a model path, a tokenizer, a reward name, a
dataset file, a prompt template) is checked in `prepare`, before anything is compiled, and fails
with a message that says what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import data
from grpo_jax.config import (ConfigError, MeshConfig, ModelConfig, RunConfig, SamplingConfig, check_micro_batches,
                             did_you_mean, unknown_key)
from grpo_jax.runtime.hosts import row_share
from grpo_jax.models.gguf import is_gguf
from grpo_jax.models.lora import add_adapters
from grpo_jax.models import (RopeConfig, Transformer, TransformerConfig, config_to_hf, from_pretrained, load_config,
                             load_tokenizer)
from grpo_jax.rewards import RewardSpec, code_reward, get_reward_fn
from grpo_jax.rewards.code import check_isolation
from grpo_jax.runtime.sharding import make_mesh, mesh_devices, mesh_shape
from grpo_jax.runtime.storage import is_remote


@dataclasses.dataclass
class Prepared:
    config: RunConfig
    tokenizer: Any
    model_config: TransformerConfig
    sampling: SamplingConfig  # the run's sampling config with stop/pad ids resolved from the tokenizer
    eval_sampling: SamplingConfig  # the same with eval.k samples per prompt at eval.temperature
    rewards: list[RewardSpec]
    eval_reward: RewardSpec
    eval_verifier: RewardSpec | None  # eval.verifier: a second judge of the held-out samples
    train_stream: Any  # grpo_jax.data.PromptStream over the train split: this host's share of each batch
    eval_examples: list  # the first eval.num_prompts usable rows of the eval split, each once (every host has all)
    mesh: Any  # the run's device mesh (jit: data x fsdp x tensor; pmap: data over the local devices)
    share: Any  # grpo_jax.runtime.hosts.RowShare: this host's block of the prompts_per_step prompts of a step
    sft_stream: Any = None  # the warm start's own stream (its own share of sft.batch_size), if sft.steps
    notes: tuple[str, ...] = ()  # lines a run logs at start: the code sandbox's isolation, a short eval split


def build_tokenizer(cfg: ModelConfig):
    if cfg.tokenizer == "char":
        return data.char_tokenizer(add_bos=True)  # a BOS token gives attention a place to rest
    path = cfg.tokenizer or cfg.path
    if not is_gguf(path) and not is_remote(path) and not Path(path).exists():
        raise FileNotFoundError(f"model.tokenizer: {str(path)!r} does not exist; pass a directory with "
                                "tokenizer files (tokenizer.json ...) or \"char\"")
    return load_tokenizer(path)


def architecture(arch: Mapping[str, Any], tokenizer) -> TransformerConfig:
    """TransformerConfig from `model.architecture`; vocab size and special ids default to the tokenizer's."""
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    values = dict(arch)
    for key in values:
        if key not in fields:
            raise unknown_key(key, "model.architecture", fields)
    if "rope" in values:
        values["rope"] = {kind: RopeConfig(**rope) for kind, rope in values["rope"].items()}
    values.setdefault("vocab_size", len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        values.setdefault(name, getattr(tokenizer, name))
    if "layer_types" in values and values["layer_types"] is not None:
        values["layer_types"] = tuple(values["layer_types"])
    try:
        return TransformerConfig(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.architecture: {e}") from None


JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # model.dtype / model.param_dtype names


def build_model(cfg: ModelConfig, model_config: TransformerConfig, seed: int) -> Transformer:
    """The base policy: loaded from `model.path`, or initialised from `model.architecture` and the seed.
    (A LoRA run adds its adapters after the warm start: `add_run_adapters`.)"""
    dtypes = dict(dtype=JNP_DTYPES[cfg.dtype], param_dtype=JNP_DTYPES[cfg.param_dtype], scan_layers=cfg.scan_layers)
    if cfg.path is not None:
        return from_pretrained(cfg.path, **dtypes)
    return Transformer(model_config, rngs=nnx.Rngs(seed), **dtypes)


def add_run_adapters(model: Transformer, config: RunConfig) -> None:
    """The run's LoRA adapters (`lora.rank` > 0), drawn from the seed; nothing without."""
    lo = config.lora
    if lo.enabled:
        add_adapters(model, rank=lo.rank, alpha=lo.alpha, targets=lo.targets, dropout=lo.dropout,
                     key=jax.random.fold_in(jax.random.key(config.train.seed), 16))


def resolve_sampling(sampling: SamplingConfig, tokenizer, model_config: TransformerConfig) -> SamplingConfig:
    """Stop at the tokenizer's end-of-sequence token unless stop ids are configured; pad with the
    configured pad id, else the tokenizer's pad token, else the first stop token."""
    stops = sampling.stop_token_ids
    if not stops:
        stops = tuple(model_config.eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    if not stops:
        raise ConfigError("no stop token: the tokenizer has no eos token; set sampling.stop_token_ids")
    pad = sampling.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    outside = [t for t in (*stops, pad) if not 0 <= t < model_config.vocab_size]
    if outside:
        raise ConfigError(f"sampling: token ids {outside} (stop_token_ids / pad_token_id) are outside the model's "
                          f"vocabulary of {model_config.vocab_size}")
    return dataclasses.replace(sampling, stop_token_ids=stops, pad_token_id=pad)


def _unwrapped(fn) -> tuple[Any, dict]:
    """(the function, its bound keywords) of a reward that may be a functools.partial."""
    if isinstance(fn, functools.partial):
        return fn.func, dict(fn.keywords)
    return fn, {}


def sandbox_check(spec: RewardSpec, index: int) -> str:
    """The code reward's sandbox isolation as a line to log, checked before the run starts: without
    user, mount and PID namespaces it is refused unless its kwargs say allow_weak_isolation."""
    _, kwargs = _unwrapped(spec.fn)
    try:
        return check_isolation(allow_weak_isolation=kwargs.get("allow_weak_isolation", False),
                               python=kwargs.get("python"))
    except ValueError as e:
        raise ConfigError(f"rewards[{index}] ({spec.name}): {e}") from None


def check_reward_kwargs(fn, kwargs: Mapping[str, Any], where: str) -> None:
    """Every configured keyword is a named parameter of the reward function after (prompts,
    completions): a function's **kwargs takes the dataset's example fields, so a misspelled option
    would vanish into it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # a builtin or C function without a signature: nothing to check against
    named = [p.name for p in list(params.values())[2:]
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in named]
    if unknown:
        label = getattr(fn, "__name__", repr(fn))
        raise ConfigError(f"{where}: {unknown[0]!r} is not an option of reward {label}"
                          f"{did_you_mean(unknown[0], named)}; its options: {', '.join(named) or 'none'}")


def _reward_spec(name: str, kwargs, weight: float, where: tuple[str, str]) -> RewardSpec:
    try:
        fn = get_reward_fn(name)
    except ValueError as e:
        raise ConfigError(f"{where[0]}: {e}") from None
    if isinstance(fn, type):
        return RewardSpec(name=name, fn=_stateful_reward(fn, kwargs, where[1]), weight=weight)
    check_reward_kwargs(fn, kwargs, where[1])
    return RewardSpec(name=name, fn=functools.partial(fn, **kwargs) if kwargs else fn, weight=weight)


def _stateful_reward(cls: type, kwargs: Mapping[str, Any], where: str):
    """A reward that holds something (a reward model), built once from its kwargs: an unknown
    option, a missing one or a bad path is a ConfigError before anything trains."""
    params = inspect.signature(cls).parameters
    named = [p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in named]
    if unknown:
        raise ConfigError(f"{where}: {unknown[0]!r} is not an option of reward {cls.__name__}"
                          f"{did_you_mean(unknown[0], named)}; its options: {', '.join(named)}")
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in kwargs]
    if missing:
        raise ConfigError(f"{where}: reward {cls.__name__} needs {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except (ValueError, OSError, TypeError) as e:
        raise ConfigError(f"{where}: {type(e).__name__}: {e}") from None


def build_rewards(config: RunConfig) -> tuple[list[RewardSpec], RewardSpec, RewardSpec | None]:
    """(the training rewards, the one evaluation judges correctness by, eval.verifier's or None)."""
    if not config.rewards:
        raise ConfigError("rewards: configure at least one reward function, e.g. rewards: [{name: math_accuracy}]")
    specs = [_reward_spec(r.name, r.kwargs, r.weight, (f"rewards[{i}].name", f"rewards[{i}].kwargs")) for i, r in enumerate(config.rewards)]
    name = config.eval.reward or specs[0].name
    e = config.eval
    verifier = None if e.verifier is None else _reward_spec(e.verifier, e.verifier_kwargs, 1.0,
                                                            ("eval.verifier", "eval.verifier_kwargs"))
    return specs, next(s for s in specs if s.name == name), verifier


def initialize_distributed(config: RunConfig) -> None:
    """`jax.distributed.initialize` when the config asks for it; must run before JAX touches a device."""
    d = config.distributed
    if not d.enabled:
        return
    jax.config.update("jax_cpu_collectives_implementation", d.cpu_collectives)
    kwargs = {k: v for k, v in (("coordinator_address", d.coordinator_address), ("num_processes", d.num_processes),
                                ("process_id", d.process_id)) if v is not None}
    jax.distributed.initialize(**kwargs)


def _check_devices(config: RunConfig) -> None:
    """The mesh fits the devices and the batch splits over it (before anything compiles)."""
    if jax.process_count() > 1:
        if config.parallelism == "pmap":
            raise ConfigError(f"parallelism: pmap runs on one host; this run has {jax.process_count()} processes. "
                              "Use parallelism: jit with mesh.data: -1 for data parallelism across hosts")
        try:
            used = len(mesh_devices(config.mesh))
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None
        if used != jax.device_count():
            raise ConfigError(f"mesh: a multi-host mesh must use all {jax.device_count()} devices of the "
                              f"{jax.process_count()} processes, this one uses {used}; use -1 for one axis")
    if config.parallelism == "pmap":
        if config.mesh not in (MeshConfig(), MeshConfig(data=1, fsdp=1, tensor=1)):
            raise ConfigError("parallelism: pmap replicates the model on every local device; it takes no mesh.* "
                              "settings (leave the mesh section out) -- use parallelism: jit for fsdp/tensor "
                              "sharding")
        ways = jax.local_device_count()
    else:
        try:
            data, fsdp, _ = mesh_shape(config.mesh, len(mesh_devices(config.mesh)))
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None
        ways = data * fsdp
    if config.data.prompts_per_step % ways:
        raise ConfigError(f"data.prompts_per_step={config.data.prompts_per_step} must be a multiple of the "
                          f"{ways} ways the batch is split ({config.parallelism}: "
                          + ("local devices)" if config.parallelism == "pmap" else "mesh.data x mesh.fsdp)"))
    rows = config.data.prompts_per_step * config.sampling.group_size // ways
    try:
        check_micro_batches(rows, config.train.micro_batches, f"each of the {ways} batch shards")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    prompts = config.data.prompts_per_step // ways
    if config.train.shared_prompt and prompts % config.train.micro_batches:
        raise ConfigError(f"train.shared_prompt runs each group's prompt once, so a micro-batch holds whole groups: "
                          f"each of the {ways} batch shards has {prompts} prompts, which train.micro_batches="
                          f"{config.train.micro_batches} does not divide; change micro_batches or set "
                          "train.shared_prompt: false")
    if config.sft.steps and config.sft.batch_size % ways:
        raise ConfigError(f"sft.batch_size={config.sft.batch_size} must be a multiple of the {ways} ways the "
                          "batch is split")


def run_mesh(config: RunConfig):
    """The mesh a run samples and trains on: jit mode's (data, fsdp, tensor) mesh, or for pmap a
    data-only mesh over the local devices (the sampler's; the update itself is pmapped)."""
    if config.parallelism == "pmap":
        devices = jax.local_devices()
        return make_mesh(MeshConfig(data=len(devices)), devices)
    return make_mesh(config.mesh, mesh_devices(config.mesh))


def prepare(config: RunConfig) -> Prepared:
    """Every input check of a run, before any compile."""
    if config.model is None:
        raise ConfigError("the config has no model section; set model.path or model.architecture")
    if config.sampling.temperature == 0:
        raise ConfigError("sampling.temperature=0 (greedy) gives every group G identical completions; "
                          "GRPO needs sampling, use a temperature > 0")
    _check_devices(config)
    if config.model.path is not None:
        model_config = load_config(config.model.path)  # a missing path or config.json fails here
        local = not is_gguf(config.model.path) and not is_remote(config.model.path)
        if local and not any(Path(config.model.path).glob("*.safetensors")):
            raise FileNotFoundError(f"model.path {config.model.path!r} has no *.safetensors weights")
    tokenizer = build_tokenizer(config.model)
    if config.model.path is None:
        model_config = architecture(config.model.architecture, tokenizer)
    if len(tokenizer) > model_config.vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only "
                          f"{model_config.vocab_size}; use the model's own tokenizer")
    try:
        rewards, eval_reward, eval_verifier = build_rewards(config)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"rewards: {e}") from None
    notes = [sandbox_check(spec, i) for i, spec in enumerate(rewards) if _unwrapped(spec.fn)[0] is code_reward]
    d = config.data
    def formatter():  # one per stream: each counts what it skipped
        return data.PromptFormatter(tokenizer, template=d.template, system_prompt=d.system_prompt,
                                    chat_template=d.chat_template, max_prompt_tokens=d.max_prompt_tokens,
                                    overlong=d.overlong)

    source_kwargs = dict(data_dir=d.data_dir, manual_dir=d.manual_dir, builder_config=d.builder_config,
                         **d.builder_kwargs)
    try:
        train_source = data.load_source(d.name, d.train_split, **source_kwargs)
        eval_source = data.load_source(d.name, d.eval_split, **source_kwargs)
    except (ValueError, TypeError) as e:  # a dataset name, split or builder setting the user chose
        raise ConfigError(f"data: {e}") from None
    # Each host reads only its block of every batch (see grpo_jax.runtime.hosts): its share of the data
    # sampler, dealt in blocks of its share's size, so the hosts' blocks side by side are the batch a
    # single process would read.
    mesh = run_mesh(config)

    def stream(batch: int, seed: int):
        share = row_share(mesh, batch)
        sampler = data.IndexSampler(len(train_source), seed=seed, process_index=share.index,
                                    process_count=share.count, block=share.size)
        return data.PromptStream(train_source, sampler, formatter()), share

    train_stream, share = stream(d.prompts_per_step, config.train.seed)
    # The warm start reads its own stream (another seed), so GRPO's batches do not depend on it.
    sft_stream = stream(config.sft.batch_size, config.train.seed + 1)[0] if config.sft.steps else None
    eval_formatter = formatter()
    eval_examples, rejected = data.first_usable(eval_source, eval_formatter, config.eval.num_prompts)
    if not eval_examples:
        raise ConfigError(f"data.eval_split {d.eval_split!r}: none of its {len(eval_source)} rows makes a usable "
                          f"prompt (the last: {eval_formatter.last_skip_reason}); check data.template's fields "
                          "and data.max_prompt_tokens")
    if len(eval_examples) < config.eval.num_prompts:
        notes.append(f"eval: {len(eval_examples)} prompts, not eval.num_prompts={config.eval.num_prompts}: the "
                     f"{d.eval_split!r} split has {len(eval_source)} rows, {rejected} of them unusable (too long or "
                     "missing template fields); each prompt is evaluated once")
    sampling = resolve_sampling(config.sampling, tokenizer, model_config)
    eval_sampling = dataclasses.replace(sampling, group_size=config.eval.k, min_new_tokens=0, temperature=(
        sampling.temperature if config.eval.temperature is None else config.eval.temperature))
    return Prepared(config=config, tokenizer=tokenizer, model_config=model_config, sampling=sampling,
                    eval_sampling=eval_sampling, rewards=rewards,
                    eval_reward=eval_reward, eval_verifier=eval_verifier, train_stream=train_stream, eval_examples=eval_examples, mesh=mesh,
                    share=share, sft_stream=sft_stream, notes=tuple(notes))


def model_json(prepared: Prepared) -> dict:
    """The HF config.json of the run's architecture (what `write_model_files` writes)."""
    return config_to_hf(prepared.model_config, dtype_name=prepared.config.model.param_dtype)


def write_model_files(prepared: Prepared, directory: Path) -> None:
    """The architecture (config.json) and tokenizer a checkpoint's params belong to."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_json(prepared), indent=2))
    prepared.tokenizer.save_pretrained(str(directory))
