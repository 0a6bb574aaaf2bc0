"""Frozen, validated run configuration: one small dataclass per concern, and YAML loading.

A YAML file maps section by section onto `RunConfig` (`model:`, `data:`, `rewards:`, `sampling:`,
`grpo:`, `train:`, `sft:`, `eval:`, `checkpoint:`, `mesh:`, `parallelism:`, `distributed:`). An unknown key fails
with the valid keys of its section and the nearest match; `--set section.key=value` overrides are
parsed as YAML scalars and go through the same checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo_jax.grpo import ESTIMATORS, KL_ESTIMATORS, SCALES
from grpo_jax.sampling import SamplingConfig

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"grpo.{name}={value!r} is not one of {list(choices)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """The GRPO objective: advantages, clipping, aggregation, KL and entropy terms.

    ratio_level "token" is GRPO/DAPO's per-token importance ratio; "sequence" is GSPO's
    length-normalised sequence ratio (its clip range is ~1e-3, not ~0.2). loss_agg:
    "token_mean" (DAPO), "seq_mean_token_mean" (original GRPO), "seq_mean_token_sum_norm"
    (Dr. GRPO: token sum divided by the constant max_completion_length).
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # > epsilon_low is DAPO's clip-higher
    dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens at c * |A|
    ratio_level: Literal["token", "sequence"] = "token"
    loss_agg: LossAggregation = "token_mean"
    max_completion_length: int | None = None  # required by seq_mean_token_sum_norm
    beta: float = 0.0  # KL coefficient; 0 = no reference model is held or run
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss
    advantage_scale: Literal["group", "batch", "none"] = "group"
    advantage_estimator: Literal["grpo", "rloo"] = "grpo"
    advantage_eps: float = 1e-6
    num_iterations: int = 1  # mu: policy updates per rollout

    def __post_init__(self):
        _choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _choice("loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("advantage_scale", self.advantage_scale, SCALES)
        _choice("advantage_estimator", self.advantage_estimator, ESTIMATORS)
        if not 0 < self.epsilon_low < 1:
            raise ValueError(f"grpo.epsilon_low must be in (0, 1), got {self.epsilon_low}")
        if self.epsilon_high < self.epsilon_low:
            raise ValueError(
                f"grpo.epsilon_high={self.epsilon_high} < epsilon_low={self.epsilon_low}: clip-higher needs "
                "epsilon_high >= epsilon_low"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"grpo.dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.loss_agg == "seq_mean_token_sum_norm" and not (self.max_completion_length or 0) > 0:
            raise ValueError("grpo.loss_agg=seq_mean_token_sum_norm needs a positive grpo.max_completion_length")
        for name in ("beta", "entropy_coef", "advantage_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"grpo.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_iterations < 1:
            raise ValueError(f"grpo.num_iterations must be >= 1, got {self.num_iterations}")
        if self.ratio_level == "sequence" and max(self.epsilon_low, self.epsilon_high) >= 0.01:
            warnings.warn(
                f"GSPO (ratio_level=sequence) with epsilon {self.epsilon_low}/{self.epsilon_high}: sequence "
                "ratios are length-normalised and need clip ranges near 3e-4/4e-4; token-level epsilons "
                "almost never clip",
                stacklevel=2,
            )


DTYPES: tuple[str, ...] = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Where the policy comes from: an HF-format directory (`path`), or a random initialisation of
    `architecture` (TransformerConfig fields; vocab_size defaults to the tokenizer's) for demos.

    tokenizer: a directory with tokenizer files (default: `path`), or "char" for the built-in
    character-level tokenizer.
    """

    path: str | None = None
    architecture: Mapping[str, Any] | None = None
    tokenizer: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights

    def __post_init__(self):
        if (self.path is None) == (self.architecture is None):
            raise ValueError("model: set exactly one of model.path (an HF model directory) and "
                             "model.architecture (a random initialisation)")
        if self.path is None and self.tokenizer is None:
            raise ValueError("model.architecture needs model.tokenizer (a tokenizer directory or \"char\")")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"model.{name}={getattr(self, name)!r} is not one of {list(DTYPES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts: a TFDS dataset (project builders `arithmetic`, `countdown`, or `gsm8k`) and how rows
    become prompt tokens (the tokenizer's chat template when it has one, else `template`)."""

    name: str = "arithmetic"
    builder_config: str | None = None  # TFDS builder config name
    # Synthetic builders: overrides of the config's fields (num_train, seed, digits, ops, formats, ...);
    # each distinct set is built into its own directory.
    builder_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    data_dir: str = "data/tfds"
    manual_dir: str | None = None  # gsm8k offline: the directory holding its jsonl files
    train_split: str = "train"
    eval_split: str = "test"
    template: str = "{question}"
    system_prompt: str | None = None
    chat_template: Literal["auto", "always", "never"] = "auto"
    max_prompt_tokens: int = 256
    overlong: Literal["skip", "truncate"] = "skip"
    prompts_per_step: int = 8

    def __post_init__(self):
        _choice_in("data", "chat_template", self.chat_template, ("auto", "always", "never"))
        _choice_in("data", "overlong", self.overlong, ("skip", "truncate"))
        _positive("data", "max_prompt_tokens", self.max_prompt_tokens)
        _positive("data", "prompts_per_step", self.prompts_per_step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """One reward function by its registered name (`grpo_jax.rewards.REWARD_FUNCTIONS`), its weight,
    and keyword arguments bound to it."""

    name: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 100
    seed: int = 0
    learning_rate: float = 1e-6
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    micro_batches: int = 1
    logprob_chunk: int = 128
    # DAPO dynamic sampling: keep only groups whose rewards differ, resample up to this many extra
    # rounds to fill the batch; what is still missing is filled with zero-advantage groups (counted).
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3
    max_consecutive_skips: int = 5  # abort after this many non-finite updates in a row
    samples_every: int = 10  # log a few completions with their rewards every N steps (0 = never)
    samples_count: int = 4
    progress: bool = True
    # A run directory that already holds checkpoints is resumed from its newest one (after a
    # preemption, run the same command again); false refuses to touch it.
    resume: bool = True

    def __post_init__(self):
        _positive("train", "steps", self.steps)
        _positive("train", "learning_rate", self.learning_rate)
        _positive("train", "micro_batches", self.micro_batches)
        _positive("train", "logprob_chunk", self.logprob_chunk)
        _positive("train", "max_consecutive_skips", self.max_consecutive_skips)
        _choice_in("train", "lr_schedule", self.lr_schedule, ("constant", "cosine"))
        for name in ("warmup_steps", "max_resample_rounds", "samples_every", "samples_count", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """A supervised warm start run by the same command before GRPO (steps 0 = none): cross-entropy on
    the dataset's `answer_template` completions, with AdamW at `learning_rate` and the train
    section's `adam_b1`, `adam_b2`, `adam_eps`."""

    steps: int = 0
    learning_rate: float = 1e-3
    batch_size: int = 32
    answer_template: str = "{answer}"

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"sft.steps must be >= 0, got {self.steps}")
        _positive("sft", "learning_rate", self.learning_rate)
        _positive("sft", "batch_size", self.batch_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation every `every` steps (0 = only before the first and after the last step):
    `k` samples for each of `num_prompts` prompts; accuracy = mean correctness of all samples,
    pass@k = share of prompts with at least one correct sample. Correct = `reward` function > 0.5
    (default: the first configured reward)."""

    every: int = 0
    num_prompts: int = 64
    k: int = 4
    temperature: float | None = None  # None = sampling.temperature
    reward: str | None = None

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"eval.every must be >= 0, got {self.every}")
        _positive("eval", "num_prompts", self.num_prompts)
        _positive("eval", "k", self.k)
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 0  # 0 = only at the end
    keep: int = 3

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")
        _positive("checkpoint", "keep", self.keep)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes along `data`, `fsdp`, `tensor` (see grpo_jax.sharding); -1 = the rest."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            raise ValueError(f"mesh sizes must be positive, with at most one -1, got {sizes}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """`jax.distributed.initialize` for multi-host runs. On TPU pods the arguments are discovered
    from the environment (leave them unset); elsewhere give the coordinator's address, the number
    of processes and this process's id (or JAX's env vars). `cpu_collectives` picks the CPU
    backend's cross-process collectives (gloo) for CPU-only multi-process runs."""

    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    cpu_collectives: Literal["gloo", "mpi"] = "gloo"

    def __post_init__(self):
        _choice_in("distributed", "cpu_collectives", self.cpu_collectives, ("gloo", "mpi"))
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"distributed.process_id={self.process_id} is not in [0, {self.num_processes})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A run's whole configuration; checks that span sections live here."""

    model: ModelConfig | None = None
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rewards: tuple[RewardConfig, ...] = ()
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    parallelism: Literal["jit", "pmap"] = "jit"
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        object.__setattr__(self, "rewards", tuple(self.rewards))
        _choice_in("run", "parallelism", self.parallelism, ("jit", "pmap"))
        if self.sampling.group_size < 2:
            raise ValueError(
                f"sampling.group_size={self.sampling.group_size}: GRPO normalises rewards within a group, "
                "which needs at least 2 samples per prompt"
            )
        cap = self.grpo.max_completion_length
        if cap is not None and cap < self.sampling.max_new_tokens:
            raise ValueError(
                f"grpo.max_completion_length={cap} is below sampling.max_new_tokens="
                f"{self.sampling.max_new_tokens}; Dr. GRPO's constant must be at least the longest completion"
            )
        if self.data.max_prompt_tokens > max(self.sampling.prompt_buckets):
            raise ValueError(
                f"data.max_prompt_tokens={self.data.max_prompt_tokens} exceeds the largest sampling.prompt_buckets "
                f"entry {max(self.sampling.prompt_buckets)}; raise the buckets or lower the limit")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: each function may appear once, got {names}")
        if self.eval.reward is not None and self.eval.reward not in names:
            raise ValueError(f"eval.reward={self.eval.reward!r} is not a configured reward; configured: {names}")
        rows = self.data.prompts_per_step * self.sampling.group_size
        if rows % self.train.micro_batches:
            raise ValueError(f"data.prompts_per_step * sampling.group_size = {rows} rows do not split into "
                             f"train.micro_batches={self.train.micro_batches}")


def _choice_in(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {list(choices)}")


def _positive(section: str, name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{section}.{name} must be > 0, got {value}")


# --- YAML -------------------------------------------------------------------------------------

_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "sampling": SamplingConfig, "grpo": GRPOConfig,
    "train": TrainConfig, "sft": SFTConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig,
    "mesh": MeshConfig, "distributed": DistributedConfig,
}
_TOP_LEVEL = (*_SECTIONS, "rewards", "parallelism")


class ConfigError(ValueError):
    """A configuration file or override that cannot become a RunConfig."""


def _unknown(key: str, where: str, valid: Sequence[str]) -> ConfigError:
    near = difflib.get_close_matches(key, list(valid), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ConfigError(f"unknown key {key!r} in {where}{hint} Valid keys: {', '.join(sorted(valid))}")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """YAML lists become tuples where the field is a tuple; ints are fine for floats."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where) if len(args) == 1 else value
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if annotation is bool and not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    return value


def _build(cls: type, values: Any, where: str):
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise _unknown(str(key), where, fields)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a missing required field
        raise ConfigError(f"{where}: {e}") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def config_from_dict(raw: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from nested plain data (a parsed YAML file)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "model" and value is None:
            continue
        if key in _SECTIONS:
            kwargs[key] = _build(_SECTIONS[key], value or {}, key)
        elif key == "rewards":
            if not isinstance(value, list):
                raise ConfigError("rewards must be a list of {name, weight, kwargs} entries")
            kwargs[key] = tuple(_build(RewardConfig, v, f"rewards[{i}]") for i, v in enumerate(value))
        elif key == "parallelism":
            kwargs[key] = value
        else:
            raise _unknown(str(key), "the config's top level", _TOP_LEVEL)
    try:
        return RunConfig(**kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`section.key=value` overrides (values parsed as YAML) applied to a parsed config."""
    raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        value = yaml.safe_load(text) if text else None
        parts = key.strip().split(".")
        if len(parts) == 1:
            if parts[0] not in _TOP_LEVEL:
                raise _unknown(parts[0], "the config's top level", _TOP_LEVEL)
            raw[parts[0]] = value
        elif len(parts) == 2 and parts[0] in _SECTIONS:
            section, name = parts
            valid = {f.name for f in dataclasses.fields(_SECTIONS[section]) if f.init}
            if name not in valid:
                raise _unknown(name, section, valid)
            raw.setdefault(section, {})
            raw[section] = dict(raw[section] or {})
            raw[section][name] = value
        else:
            if parts[0] not in _SECTIONS:
                raise _unknown(parts[0], "the config's top level", _TOP_LEVEL)
            raise ConfigError(f"--set {key}: use section.key (one dot), e.g. train.steps=10")
    return raw


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML config file, apply `--set` overrides, validate everything."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file such as configs/demo_cpu.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, data:, ...)")
    return config_from_dict(apply_overrides(dict(raw), overrides))


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    """Plain data (lists, not tuples) that `config_from_dict` turns back into the same RunConfig."""

    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        if isinstance(x, (tuple, list)):
            return [plain(v) for v in x]
        if isinstance(x, Mapping):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(config)
