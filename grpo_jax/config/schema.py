"""The run configuration's schema: one small frozen dataclass per concern, validated in
`__post_init__`, and the choices each variant may take. Imports nothing but the standard library."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Literal

Scale = Literal["group", "batch", "none"]
Estimator = Literal["grpo", "rloo"]
SCALES: tuple[str, ...] = ("group", "batch", "none")
ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the sampler draws G completions per prompt (grpo_jax.rollout.sampling.generate)."""

    group_size: int = 8
    max_new_tokens: int = 256
    min_new_tokens: int = 0  # stop tokens cannot be drawn before this many (0 = off)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_token_ids: tuple[int, ...] = ()
    prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
    # The id written after a completion's stop token and left of a padded prompt. A run sets it from
    # the tokenizer (its pad token, else the first stop token) unless the config gives one.
    pad_token_id: int | None = None
    # Generated slots are split into this many chunks; phase i attends the prompt and chunks 1..i,
    # not the whole cache. Each phase compiles one more decode step (4 -> 8 was slower on CPU).
    attend_phases: int = 4

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "prompt_buckets", tuple(sorted(int(b) for b in self.prompt_buckets)))
        if self.group_size < 1:
            raise ValueError(f"sampling.group_size must be >= 1, got {self.group_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"sampling.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.attend_phases < 1:
            raise ValueError(f"sampling.attend_phases must be >= 1, got {self.attend_phases}")
        if not self.prompt_buckets or self.prompt_buckets[0] < 1:
            raise ValueError(f"sampling.prompt_buckets must be positive lengths, got {self.prompt_buckets}")
        if self.pad_token_id is not None and self.pad_token_id < 0:
            raise ValueError(f"sampling.pad_token_id must be >= 0, got {self.pad_token_id}")

    @property
    def pad_id(self) -> int:
        """The pad id to write (0 when none was set or resolved from a tokenizer)."""
        return 0 if self.pad_token_id is None else self.pad_token_id


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
    advantage_scale: Scale = "group"
    advantage_estimator: Estimator = "grpo"
    advantage_eps: float = 1e-6
    num_iterations: int = 1  # mu: policy updates per rollout
    # Truncated importance sampling for a sampler whose log-probs differ from the trainer's (bf16
    # sampling, another engine): each token's loss is weighted by min(pi_train / pi_sampler, cap),
    # the trainer's and sampler's probabilities of the sampled token. None = off. The difference is
    # measured on every run either way (health/sampler_train_logprob_diff).
    sampler_is_cap: float | None = None

    def __post_init__(self):
        _choice_in("grpo", "ratio_level", self.ratio_level, RATIO_LEVELS)
        _choice_in("grpo", "loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        _choice_in("grpo", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice_in("grpo", "advantage_scale", self.advantage_scale, SCALES)
        _choice_in("grpo", "advantage_estimator", self.advantage_estimator, ESTIMATORS)
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
        if self.sampler_is_cap is not None and self.sampler_is_cap < 1:
            raise ValueError(f"grpo.sampler_is_cap must be >= 1 (or null = off), got {self.sampler_is_cap}")
        if self.ratio_level == "sequence" and max(self.epsilon_low, self.epsilon_high) >= 0.01:
            warnings.warn(
                f"GSPO (ratio_level=sequence) with epsilon {self.epsilon_low}/{self.epsilon_high}: sequence "
                "ratios are length-normalised and need clip ranges near 3e-4/4e-4; token-level epsilons "
                "almost never clip",
                stacklevel=2,
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """The critic baseline (`algorithm: ppo`): a linear value head on the policy's final hidden
    states (a shared trunk), trained with the policy by a clipped value loss weighted by
    `value_coef`; per-token advantages by GAE(gamma, lam) with the sequence's reward on its last
    token. The policy loss is GRPO's clipped surrogate with the `grpo` section's clip range,
    aggregation and KL term, so the two algorithms differ only in where advantages come from."""

    gamma: float = 1.0
    lam: float = 0.95
    value_coef: float = 0.5
    value_clip: float = 0.2  # |V - V_old| beyond this is clipped in the value loss (PPO2)
    # The value head's own AdamW learning rate (constant); None = train.learning_rate and its
    # schedule. Critics usually learn faster than policies (a freshly zeroed head must catch up).
    critic_learning_rate: float | None = None

    def __post_init__(self):
        if self.critic_learning_rate is not None:
            _positive("ppo", "critic_learning_rate", self.critic_learning_rate)
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ppo.{name} must be in [0, 1], got {getattr(self, name)}")
        _positive("ppo", "value_coef", self.value_coef)
        _positive("ppo", "value_clip", self.value_clip)


LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the policy (`rank` 0 = off: full fine-tuning). With adapters only they
    train (optimizer state for them alone) and the base weights stay frozen; the KL reference
    (grpo.beta > 0) is the same model with the adapters switched off, so no second copy of the
    weights is held. The update is x W + (alpha / rank) (dropout(x) A) B on each of `targets`;
    `dropout` (PEFT's lora_dropout) acts in the training pass only, never in sampling or in the
    reference and old-policy passes."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0 = off), got {self.rank}")
        _positive("lora", "alpha", self.alpha)
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"lora.targets {list(self.targets)}: choose from {list(LORA_TARGETS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


ALGORITHMS: tuple[str, ...] = ("grpo", "ppo")
REWARD_CONTROLS: tuple[str, ...] = ("none", "random")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Where the policy comes from: an HF-format directory or a `.gguf` file (`path`), or a random initialisation of
    `architecture` (TransformerConfig fields; vocab_size defaults to the tokenizer's) for demos.

    tokenizer: a directory with tokenizer files (default: `path`), or "char" for the built-in
    character-level tokenizer.
    """

    path: str | None = None
    architecture: Mapping[str, Any] | None = None
    tokenizer: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights
    # true: the training and reference passes and the prefill run the layers in one lax.scan
    # (compile time independent of depth); false: unrolled (compile time grows with depth; the GRPO
    # update was 5-14% faster on CPU for the 4-layer benchmark model, benchmarks/RESULTS.md).
    scan_layers: bool = True

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
    """Prompts: a TFDS dataset (project builders `arithmetic`, `countdown`, `word_problems`, or `gsm8k`) and how rows
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
    # The policy and reference passes run each group's prompt once and let its G completions attend
    # to it (equal to every row carrying its own copy, tests/learner/test_shared_prompt.py; 1.2-1.4x faster
    # updates on the peers' workload). Micro-batches must then hold whole groups.
    shared_prompt: bool = True
    # DAPO dynamic sampling: keep only groups whose rewards differ, resample up to this many extra
    # rounds to fill the batch; what is still missing is filled with zero-advantage groups (counted).
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3
    max_consecutive_skips: int = 5  # abort after this many non-finite updates in a row
    # Stop the run when a reward function raised on every sample of this many steps in a row (its
    # message is logged every step it fails; `reward/<fn>/failures` counts the samples).
    max_reward_failure_steps: int = 3
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
        _positive("train", "max_reward_failure_steps", self.max_reward_failure_steps)
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
    # A second, independent judge of the same held-out samples (a registered reward name or
    # module:function, with `verifier_kwargs`), e.g. math_accuracy with {verifier: math_verify}
    # beside a regex-checked training reward: eval/verifier_accuracy and
    # health/verifier_disagreement (the share of judged samples the two judges disagree on).
    verifier: str | None = None
    verifier_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.verifier_kwargs and self.verifier is None:
            raise ValueError("eval.verifier_kwargs is set but eval.verifier is not")
        if self.every < 0:
            raise ValueError(f"eval.every must be >= 0, got {self.every}")
        _positive("eval", "num_prompts", self.num_prompts)
        _positive("eval", "k", self.k)
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When the trainer saves: every `every` steps, after any step that ends `every_minutes` or more
    after the last save (0 turns either off), at the last step, and at the step a SIGTERM/SIGINT
    (preemption) arrives in; a preempted run always has something to resume from."""

    every: int = 100
    every_minutes: float = 30.0
    keep: int = 3

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")
        if self.every_minutes < 0:
            raise ValueError(f"checkpoint.every_minutes must be >= 0, got {self.every_minutes}")
        _positive("checkpoint", "keep", self.keep)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes along `data`, `fsdp`, `tensor` (see grpo_jax.runtime.sharding); -1 = the rest.
    By default every device is used, fully sharded (`fsdp: -1`, as MaxText does); an unset `fsdp`
    is 1 when another axis takes the rest (`data: -1` alone is data parallelism)."""

    data: int = 1
    fsdp: int | None = None  # None: -1, or 1 when data or tensor is -1
    tensor: int = 1

    def __post_init__(self):
        if self.fsdp is None:
            object.__setattr__(self, "fsdp", 1 if -1 in (self.data, self.tensor) else -1)
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
    # grpo: group-relative advantages (GRPO, Dr. GRPO, RLOO by the grpo section's options); ppo: a
    # critic and GAE (the ppo section). Same sampler, data, mesh and checkpoints.
    algorithm: Literal["grpo", "ppo"] = "grpo"
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    # random: the update sees coin flips with the batch's mean reward instead of the rewards (the
    # spurious-reward control); the true rewards are still logged (reward/*) and evaluated.
    reward_control: Literal["none", "random"] = "none"
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self):
        object.__setattr__(self, "rewards", tuple(self.rewards))
        _choice_in("run", "parallelism", self.parallelism, ("jit", "pmap"))
        _choice_in("run", "algorithm", self.algorithm, ALGORITHMS)
        _choice_in("run", "reward_control", self.reward_control, REWARD_CONTROLS)
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
        if self.lora.enabled and self.parallelism == "pmap":
            raise ValueError("lora with parallelism: pmap is not supported yet; use parallelism: jit (the default)")
        if self.algorithm != "ppo" and self.ppo != PPOConfig():
            raise ValueError(f"ppo: {self.ppo} is set, but the ppo section applies only with algorithm: ppo (this "
                             f"run's algorithm is {self.algorithm}); set algorithm: ppo or remove the ppo section")
        if self.algorithm == "ppo" and self.grpo.num_iterations > 1:
            raise ValueError("algorithm: ppo with grpo.num_iterations > 1 is not supported yet: its old values would "
                             "need a separate value pass before the updates; use num_iterations: 1")
        if self.grpo.sampler_is_cap is not None and self.grpo.num_iterations > 1:
            raise ValueError(
                "grpo.sampler_is_cap with grpo.num_iterations > 1 is not supported: the ratio's old policy would be "
                "the sampler's, not the trainer's; use num_iterations: 1 with the correction, or turn it off")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: each function may appear once, got {names}")
        if self.eval.reward is not None and self.eval.reward not in names:
            raise ValueError(f"eval.reward={self.eval.reward!r} is not a configured reward; configured: {names}")
        check_micro_batches(self.data.prompts_per_step * self.sampling.group_size, self.train.micro_batches,
                            "data.prompts_per_step x sampling.group_size")


def check_micro_batches(rows: int, micro_batches: int, what: str) -> None:
    """The one rule for micro-batching: the rows each device updates on split evenly into
    `train.micro_batches` (checked on the config, on each batch shard before compiling, and on
    every Batch the train step takes)."""
    if rows % micro_batches:
        raise ValueError(f"{what} = {rows} rows do not split into train.micro_batches={micro_batches}")


def _choice_in(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {list(choices)}")


def _positive(section: str, name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{section}.{name} must be > 0, got {value}")
