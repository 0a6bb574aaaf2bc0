"""How and where the run trains: `train:` (the optimizer and the loop's limits), `sft:` (a supervised
warm start), `checkpoint:`, `mesh:` (device mesh sizes) and `distributed:` (multi-host start)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, get_args

from grpo_jax.config.checks import choice_in, non_negative, positive

LRSchedule = Literal["constant", "cosine"]
CPUCollectives = Literal["gloo", "mpi"]
LR_SCHEDULES: tuple[str, ...] = get_args(LRSchedule)
CPU_COLLECTIVES: tuple[str, ...] = get_args(CPUCollectives)

@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """One optimizer, as grpo_jax.learner.optimizer.make_optimizer builds every optimizer of the
    package: global-norm clipping at `max_grad_norm` (None: none), then AdamW at `learning_rate`
    (`lr_schedule`: constant, with a linear warm-up over `warmup_steps` when set, or "cosine":
    warm-up then cosine decay to 0 at `total_steps`). Not a YAML section: a section gives its own
    (`TrainConfig.optimizer`, `RMTrainConfig.optimizer`)."""

    learning_rate: float
    lr_schedule: LRSchedule = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    max_grad_norm: float | None = 1.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        positive("optimizer", "learning_rate", self.learning_rate)
        choice_in("optimizer", "lr_schedule", self.lr_schedule, LR_SCHEDULES)
        for name in ("warmup_steps", "total_steps", "weight_decay"):
            non_negative("optimizer", name, getattr(self, name))
        if self.lr_schedule == "cosine" and self.total_steps <= max(self.warmup_steps, 1):
            raise ValueError(f"train.lr_schedule: cosine decays after its warm-up, so train.warmup_steps "
                             f"({self.warmup_steps}) must be below train.steps ({self.total_steps})")
        if self.max_grad_norm is not None:
            positive("optimizer", "max_grad_norm", self.max_grad_norm)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 100
    seed: int = 0
    learning_rate: float = 1e-6
    lr_schedule: LRSchedule = "constant"
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
    # Sequence packing (grpo_jax.learner.packing): the policy, reference and teacher passes run each
    # micro-batch's rows laid end to end in bins of `pack_length` tokens (first-fit decreasing;
    # positions restart per sequence, attention never crosses sequences) instead of each row padded
    # to the longest; the loss and every metric stay per sequence. pack_length 0: the longest prompt
    # bucket + sampling.max_new_tokens (every sequence fits); a sequence longer than a bin is refused.
    packing: bool = False
    pack_length: int = 0
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
        positive("train", "steps", self.steps)
        positive("train", "learning_rate", self.learning_rate)
        positive("train", "micro_batches", self.micro_batches)
        positive("train", "logprob_chunk", self.logprob_chunk)
        positive("train", "max_consecutive_skips", self.max_consecutive_skips)
        positive("train", "max_reward_failure_steps", self.max_reward_failure_steps)
        choice_in("train", "lr_schedule", self.lr_schedule, LR_SCHEDULES)
        for name in ("warmup_steps", "max_resample_rounds", "samples_every", "samples_count", "weight_decay",
                     "pack_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        positive("train", "max_grad_norm", self.max_grad_norm)

    @property
    def optimizer(self) -> OptimizerConfig:
        """The policy's optimizer: this section's learning rate, schedule over `steps`, clipping,
        weight decay and Adam's betas and eps."""
        return OptimizerConfig(learning_rate=self.learning_rate, lr_schedule=self.lr_schedule,
                               warmup_steps=self.warmup_steps, total_steps=self.steps,
                               max_grad_norm=self.max_grad_norm, weight_decay=self.weight_decay, b1=self.adam_b1,
                               b2=self.adam_b2, eps=self.adam_eps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """A supervised warm start run by the same command before GRPO (steps 0 = none): cross-entropy on
    the dataset's `answer_template` completions, with AdamW at `learning_rate` and the train
    section's `adam_b1`, `adam_b2`, `adam_eps`.

    With an `environment` the warm start learns from worked episodes instead: `turns` are the model's
    turns (str.format templates over the row's fields, e.g. `["<calculator>{a}*{b}</calculator>",
    "{answer}"]`), and the environment answers each one for real, so the trajectory is token for token
    what an episode would sample; the loss covers the model's turns only (grpo_jax.episodes.runner
    `worked_episodes`)."""

    steps: int = 0
    learning_rate: float = 1e-3
    batch_size: int = 32
    answer_template: str = "{answer}"
    turns: tuple[str, ...] = ()

    def __post_init__(self):
        non_negative("sft", "steps", self.steps)
        positive("sft", "learning_rate", self.learning_rate)
        positive("sft", "batch_size", self.batch_size)
        object.__setattr__(self, "turns", tuple(self.turns))
        if not all(isinstance(t, str) and t for t in self.turns):
            raise ValueError(f"sft.turns must be non-empty template strings, got {list(self.turns)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When the trainer saves: every `every` steps, after any step that ends `every_minutes` or more
    after the last save (0 turns either off), at the last step, and at the step a SIGTERM/SIGINT
    (preemption) arrives in; a preempted run always has something to resume from."""

    every: int = 100
    every_minutes: float = 30.0
    keep: int = 3

    def __post_init__(self):
        non_negative("checkpoint", "every", self.every)
        non_negative("checkpoint", "every_minutes", self.every_minutes)
        positive("checkpoint", "keep", self.keep)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes along `data`, `fsdp`, `expert`, `tensor` (see grpo_jax.runtime.sharding);
    -1 = the rest. By default every device is used, fully sharded (`fsdp: -1`, as MaxText does); an
    unset `fsdp` is 1 when another axis takes the rest (`data: -1` alone is data parallelism).
    `expert`: expert parallelism for mixture-of-experts models (each device holds 1/expert of the
    experts; batch rows are split over it as over data and fsdp)."""

    data: int = 1
    fsdp: int | None = None  # None: -1, or 1 when data, expert or tensor is -1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        if self.fsdp is None:
            object.__setattr__(self, "fsdp", 1 if -1 in (self.data, self.expert, self.tensor) else -1)
        sizes = (self.data, self.fsdp, self.expert, self.tensor)
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
    cpu_collectives: CPUCollectives = "gloo"

    def __post_init__(self):
        choice_in("distributed", "cpu_collectives", self.cpu_collectives, CPU_COLLECTIVES)
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"distributed.process_id={self.process_id} is not in [0, {self.num_processes})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogConfig:
    """What a run reports besides metrics.jsonl and TensorBoard (grpo_jax.observe).

    `every`: off a terminal (nohup, a pod's log file), one line per `every` steps with the step,
    reward, accuracy, KL, tokens/s, seconds per step and ETA (0: none; a terminal gets the progress
    bar instead). `wandb`: Weights & Biases, the keyword arguments of `wandb.init` (project, entity,
    name, tags, mode: `offline` writes RUN_DIR/wandb for `wandb sync`); null: off. `mlflow`: MLflow,
    `{tracking_uri, experiment, run_name}` (when not given: SQLite in RUN_DIR/mlflow.db, artifacts in
    RUN_DIR/mlflow_artifacts); null: off.
    """

    every: int = 1
    wandb: Mapping[str, Any] | None = None
    mlflow: Mapping[str, Any] | None = None

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"log.every must be >= 0, got {self.every}")
        unknown = set(self.mlflow or {}) - {"tracking_uri", "experiment", "run_name"}
        if unknown:
            raise ValueError(f"log.mlflow: unknown keys {sorted(unknown)}; valid: experiment, run_name, tracking_uri")
