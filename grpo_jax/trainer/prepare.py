"""From a RunConfig to the objects a run needs: tokenizer, policy, reward functions, prompt streams.

Everything that can fail because of the user's input (a model path, a tokenizer, a reward name, a
dataset file, a prompt template) is checked in `prepare`, before anything is compiled, and fails
with a message that says what to do.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from grpo_jax import data
from grpo_jax.config import ConfigError, EvalConfig, ModelConfig, RunConfig, SamplingConfig
from grpo_jax.data.stream import PromptStream
from grpo_jax.engine.sampling import greedy_completions
from grpo_jax.models import TransformerConfig, config_to_hf, load_config
from grpo_jax.models.hf_tensors import TensorReader
from grpo_jax.models.build import architecture, build_tokenizer
from grpo_jax.models.gguf import is_gguf
from grpo_jax.rewards import build_rewards
from grpo_jax.rewards.registry import sandbox_notes
from grpo_jax.rollout.inputs import EvalInputs, RolloutInputs, Tokenizer
from grpo_jax.rollout.retention import GENERAL_CORPUS, Retention, build_corpus, read_rows
from grpo_jax.episodes.episode import EpisodeLimits
from grpo_jax.env.registry import environment_maker
from grpo_jax.episodes.runner import EpisodeRunner
from grpo_jax.runtime.devices import check_capacity, check_devices, check_moe, run_mesh, sampler_mesh
from grpo_jax.runtime.hosts import row_share
from grpo_jax.runtime.platform import platform_of
from grpo_jax.models.dispatch import check_run
from grpo_jax.runtime.sharding import rows_per_shard
from grpo_jax.runtime.storage import is_remote
from grpo_jax.trainer.side_models import check_side_model
from grpo_jax.learner.objectives import objective_class
from grpo_jax.engine.engines import engine_of
from grpo_jax.engine.sizing import resolve_kv_cache
from grpo_jax.trainer.construct import held_bytes


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """The policy's inputs: its tokenizer and architecture."""

    tokenizer: Tokenizer
    config: TransformerConfig


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A run's inputs, checked (`prepare`): the model's, the rollout source's (`rollout`, declared by
    grpo_jax.rollout.inputs), evaluation's (`eval`), the warm start's prompt stream and the lines the
    run logs at start."""

    config: RunConfig
    model: ModelInputs
    rollout: RolloutInputs
    eval: EvalInputs
    sft_stream: PromptStream | None = None  # the warm start's own stream (its own share of sft.batch_size)
    notes: tuple[str, ...] = ()  # lines a run logs at start: the code sandbox's isolation, a short eval split

    @property
    def mesh(self) -> Mesh:
        """The run's device mesh (jit: data x fsdp x expert x tensor; pmap: data over the local devices)."""
        return self.rollout.mesh


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


def engine_notes(sampling: SamplingConfig, mesh: Mesh, *, dynamic_sampling: bool) -> list[str]:
    """What a run says at start about engine settings it does not use as written: slots with the
    static engine, page settings without a page pool, slots rounded up to the mesh's row shards,
    segment steps without over-sampling."""
    defaults = SamplingConfig()
    paging = [k for k in ("kv_cache_bytes", "page_size", "paged_attention")
              if getattr(sampling, k) != getattr(defaults, k)]
    engine = engine_of(sampling)
    notes = [f"sampling.{', '.join(paging)} not used: the {engine.name} engine has no page pool (sampling.engine: "
             "paged uses them)"] if paging and not engine.pages else []
    if engine.pages and "page_size" in paging and not sampling.kv_bytes and platform_of(mesh) == "cpu":
        notes.append("sampling.page_size not used: with kv_cache_bytes 0 each slot reserves max_new_tokens of "
                     "cache, read in place (set sampling.kv_cache_bytes for a page pool)")
    if not engine.slots:
        return notes + ([f"sampling.slots={sampling.slots} is not used: the static engine decodes every row at once "
                         "(sampling.engine: paged uses slots)"] if sampling.slots else [])
    shards = rows_per_shard(mesh)
    if sampling.slots % shards:
        notes.append(f"sampling.slots={sampling.slots} -> {-(-sampling.slots // shards) * shards}: an equal "
                     f"number of slots on each of the mesh's {shards} row shards")
    if not dynamic_sampling and sampling.segment_steps != SamplingConfig.segment_steps:
        notes.append("sampling.segment_steps is used by over-sampling only (train.dynamic_sampling)")
    return notes


def size_cache(config: RunConfig, model_config, mesh: Mesh, samplers: Mesh | None, sampling: SamplingConfig):
    """`sampling.kv_cache_bytes: auto` resolved for the chips the run samples on (grpo_jax.engine.
    sizing): on the learner's mesh the run holds its train state there; on a sampler mesh of its own,
    a replicated copy of the weights. A chip too small for one sequence is a ConfigError."""
    where = samplers if samplers is not None else mesh
    return resolve_kv_cache(config, model_config, where, sampling, held=lambda: held_bytes(
        config, model_config, mesh, samples_apart=samplers is not None))


def check_attention(config: RunConfig, model_config, mesh: Mesh) -> list[str]:
    """Every attention pass of the run (grpo_jax.models.dispatch.run_needs) has an implementation
    on the mesh's platform: an explicit `model.attention` or `sampling.paged_attention` that cannot
    run one is a ConfigError in one line naming a choice that can. Returns "pass: implementation"."""
    try:
        return check_run(config, model_config, platform_of(mesh))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def evaluation_sampling(sampling: SamplingConfig, config: RunConfig) -> SamplingConfig:
    """The run's `sampling` for evaluation: eval.k samples per prompt at eval.temperature (default
    the run's), no minimum length."""
    return dataclasses.replace(sampling, group_size=config.eval.k, min_new_tokens=0, temperature=(
        sampling.temperature if config.eval.temperature is None else config.eval.temperature))


def prepare(config: RunConfig) -> Prepared:
    """Every input check of a run, before any compile."""
    if config.model is None:
        raise ConfigError("the config has no model section; set model.path or model.architecture")
    if config.sampling.temperature == 0:
        raise ConfigError("sampling.temperature=0 (greedy) gives every group G identical completions; "
                          "GRPO needs sampling, use a temperature > 0")
    check_devices(config)
    tokenizer, model_config = _model_inputs(config.model)
    check_capacity(config, model_config)
    check_moe(config, model_config)
    check_chat_template(tokenizer, config.data)
    algorithm = objective_class(config)
    side = {"distill.teacher": config.distill.teacher if algorithm.teacher else None,
            "ppo.critic_path": config.ppo.critic_path if algorithm.critic else None}
    side_notes = []
    for what, path in side.items():
        if path is not None:
            c = check_side_model(path, what, tokenizer, model_config)
            side_notes.append(f"{what}: {path} ({c.family}, {c.num_layers} layers, hidden {c.hidden_size}, "
                              f"vocabulary {c.vocab_size}), the policy's tokenizer")
    try:
        rewards, eval_reward, eval_verifier = build_rewards(config, generate=greedy_completions)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"rewards: {e}") from None
    notes = side_notes + sandbox_notes(rewards)
    mesh = run_mesh(config)
    streams = _streams(config, tokenizer, mesh, notes)
    samplers = sampler_mesh(config)
    sampling = resolve_sampling(config.sampling, tokenizer, model_config)
    notes += engine_notes(sampling, mesh, dynamic_sampling=config.train.dynamic_sampling)
    sampling, sized = size_cache(config, model_config, mesh, samplers, sampling)
    notes += [sized.line()] if sized is not None else []
    eval_sampling = evaluation_sampling(sampling, config)
    check_attention(config, model_config, mesh)
    episodes = episode_runner(config, tokenizer, mesh)
    rollout = RolloutInputs(stream=streams["train_stream"], rewards=tuple(rewards), correct_by=eval_reward.name,
                            tokenizer=tokenizer,
                            sampling=sampling, mesh=mesh, share=streams["share"], sampler_mesh=samplers,
                            episodes=episodes)
    evaluation = EvalInputs(sampling=eval_sampling, reward=eval_reward, verifier=eval_verifier,
                            examples=tuple(streams["eval_examples"]), tokenizer=tokenizer,
                            mesh=rollout.sample_mesh, seed=config.train.seed + 1, episodes=episodes,
                            retention=retention_probe(config.eval, tokenizer, rollout.sample_mesh))
    return Prepared(config=config, model=ModelInputs(tokenizer=tokenizer, config=model_config), rollout=rollout,
                    eval=evaluation, sft_stream=streams["sft_stream"], notes=tuple(notes))


def retention_probe(ev: EvalConfig, tokenizer, mesh: Mesh) -> Retention | None:
    """eval.retention's probe over its corpus (tokenized here: a bad file fails before any compile)."""
    if not ev.retention:
        return None
    path = ev.retention_corpus or GENERAL_CORPUS
    try:
        corpus = build_corpus(tokenizer, read_rows(path), max_tokens=ev.retention_max_tokens, mesh=mesh)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"eval.retention_corpus: {e}") from None
    return Retention(corpus, mesh=mesh, k=ev.retention_top_k)


def episode_runner(config: RunConfig, tokenizer, mesh: Mesh) -> EpisodeRunner | None:
    """The run's environment, checked before anything is sampled (a bad name or kwargs fail here)."""
    env = config.environment
    if env is None:
        return None
    if jax.process_count() > 1:
        raise ConfigError(f"environment: episodes run on one host for now (the host steps every environment "
                          f"and reads every slot); this run has {jax.process_count()} processes")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("environment: the tokenizer has no chat template to render the environment's messages "
                          "with; use a model whose tokenizer has one (model.tokenizer: a directory with a template)")
    try:
        make_env = environment_maker(env.name, env.kwargs, tokenizer, workers=env.workers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    limits = EpisodeLimits(max_turns=env.max_turns, max_env_tokens=env.max_env_tokens,
                           max_model_tokens=config.sampling.max_new_tokens, timeout_s=env.timeout_s,
                           max_prompt_tokens=max(config.sampling.prompt_buckets))
    return EpisodeRunner(make_env=make_env, limits=limits, name=env.name, tokenizer=tokenizer,
                         segment_steps=config.sampling.segment_steps, mesh=mesh)


def _model_inputs(cfg: ModelConfig) -> tuple[Any, TransformerConfig]:
    """(tokenizer, architecture) of `model.path` or `model.architecture`, checked against each other."""
    if cfg.path is not None:
        model_config = load_config(cfg.path)  # a missing path or config.json fails here
        local = not is_gguf(cfg.path) and not is_remote(cfg.path)
        if local and not any(Path(cfg.path).glob("*.safetensors")):
            raise FileNotFoundError(f"model.path {cfg.path!r} has no *.safetensors weights")
        if local:
            TensorReader(Path(cfg.path)).close()  # every weight file's header: a truncated download fails here
    tokenizer = build_tokenizer(cfg)
    if cfg.path is None:
        model_config = architecture(cfg.architecture, tokenizer)
    if len(tokenizer) > model_config.vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only "
                          f"{model_config.vocab_size}; use the model's own tokenizer")
    return tokenizer, model_config


def check_chat_template(tokenizer, d) -> None:
    """The tokenizer's chat template renders a one-message chat (a template with a syntax error, or
    one that raises, is a config error here rather than a skipped row each time)."""
    if d.chat_template == "never" or not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja's errors (TemplateSyntaxError, TemplateError, ...) vary
        raise ConfigError(f"the chat template fails to render a one-message chat: {type(e).__name__}: {e}; fix "
                          "model.chat_template (or the tokenizer's), or set data.chat_template: never") from None


def _streams(config: RunConfig, tokenizer, mesh: Mesh, notes: list[str]) -> dict[str, Any]:
    """The prompt streams (train, the warm start's) with this host's share, and the eval prompts;
    a short eval split adds a line to `notes`."""
    d = config.data

    def formatter():  # one per stream: each counts what it skipped
        return data.PromptFormatter(tokenizer, template=d.template, system_prompt=d.system_prompt,
                                    chat_template=d.chat_template, max_prompt_tokens=d.max_prompt_tokens,
                                    overlong=d.overlong, messages_field=d.messages_field, answer_field=d.answer_field)

    if d.messages_field is not None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.messages_field {d.messages_field!r}: the tokenizer has no chat template to render "
                          "the chats with; use a model whose tokenizer has one, or data.template")
    train_source, eval_source = data_sources(d, notes)
    if d.path is not None:  # your own rows: their faults found before any model loads
        check_rows(train_source, formatter(), d, notes)

    # Each host reads only its block of every batch (see grpo_jax.runtime.hosts): its share of the
    # data sampler, dealt in blocks of its share's size, so the hosts' blocks side by side are the
    # batch a single process would read.
    def stream(batch: int, seed: int):
        share = row_share(mesh, batch)
        try:
            sampler = data.IndexSampler(len(train_source), seed=seed, process_index=share.index,
                                        process_count=share.count, block=share.size)
        except ValueError as e:  # fewer rows than a batch (a small file of your own)
            raise ConfigError(f"data: {len(train_source)} train rows of {d.path or d.name} are too few for a batch "
                              f"of {batch} prompts ({e}); lower data.prompts_per_step or give more rows") from None
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
        held = "held-out part" if d.path else f"{d.eval_split!r} split"
        notes.append(f"eval: {len(eval_examples)} prompts, not eval.num_prompts={config.eval.num_prompts}: the "
                     f"{held} has {len(eval_source)} rows, {rejected} of them unusable (too long or missing template "
                     "fields); each prompt is evaluated once")
    return dict(train_stream=train_stream, share=share, sft_stream=sft_stream, eval_examples=eval_examples)


def data_sources(d, notes: list[str]) -> tuple[Any, Any]:
    """(train rows, held-out rows): `data.path`'s (grpo_jax.data.files) or a built-in dataset's."""
    try:
        if d.path is not None:
            if d.replaced:  # a shipped config's built-in dataset, with --set data.path=FILE over it
                notes.append(f"data.path {d.path} replaces the config's built-in dataset ({', '.join(d.replaced)})")
            train, held, note = data.load_path(d.path, train_split=d.train_split, eval_split=d.eval_split,
                                               eval_path=d.eval_path, eval_fraction=d.eval_fraction,
                                               split_seed=d.split_seed, cache_dir=Path(d.data_dir) / "files")
            notes.extend([note] if note else [])
            return train, held
        kwargs = dict(data_dir=d.data_dir, manual_dir=d.manual_dir, builder_config=d.builder_config,
                      **d.builder_kwargs)
        return data.load_source(d.name, d.train_split, **kwargs), data.load_source(d.name, d.eval_split, **kwargs)
    except (ValueError, TypeError, FileNotFoundError) as e:  # a dataset name, split, file or builder setting
        raise ConfigError(f"data: {e}") from None


def check_rows(source: data.FileSource, formatter, d, notes: list[str], *, limit: int = 256, shown: int = 3) -> None:
    """Format the first `limit` rows as training will: no usable row is an error before any model
    loads; skipped ones are a note with the first few reasons."""
    columns = source.columns  # a FileSource (data.path)
    if columns and d.answer_field is not None and d.answer_field not in columns:
        raise ConfigError(f"data.answer_field {d.answer_field!r} is not a field of {source.name} (fields: "
                          f"{', '.join(columns)}); name the reference answer's field, or set data.answer_field: "
                          "null for rewards that need none")
    n, reasons = min(limit, len(source)), []
    for i in range(n):
        if formatter.encode(source[i]) is None:
            reasons.append(f"row {i}: {formatter.last_skip_reason}")
    if n and len(reasons) == n:
        raise ConfigError(f"data: none of the first {n} rows of {source.name} makes a usable prompt: "
                          + "; ".join(reasons[:shown]))
    if reasons:
        notes.append(f"data: {len(reasons)} of the first {n} rows of {source.name} are skipped and counted "
                     f"(data/skipped_rows): " + "; ".join(reasons[:shown]))


def model_json(prepared: Prepared) -> dict:
    """The HF config.json of the run's architecture (what `write_model_files` writes)."""
    return config_to_hf(prepared.model.config, dtype_name=prepared.config.model.param_dtype)


def write_model_files(prepared: Prepared, directory: Path) -> None:
    """The architecture (config.json) and tokenizer a checkpoint's params belong to."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_json(prepared), indent=2))
    prepared.model.tokenizer.save_pretrained(str(directory))
