"""The run configuration's schema: `RunConfig` over one small frozen dataclass per concern (the
sections, in `model`, `rollout`, `algorithm` and `training`), with the checks that span sections
and the top-level choices."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from grpo_jax.config.algorithm import DistillConfig, GRPOConfig, PPOConfig
from grpo_jax.config.checks import check_micro_batches, choice_in
from grpo_jax.config.model import LoRAConfig, ModelConfig, MoEConfig
from grpo_jax.config.rollout import (DataConfig, EnvironmentConfig, EvalConfig, RewardConfig, RolloutConfig,
                                     SamplingConfig)
from grpo_jax.config.training import CheckpointConfig, DistributedConfig, LogConfig, MeshConfig, SFTConfig, TrainConfig

Parallelism = Literal["jit", "pmap"]
Algorithm = Literal["grpo", "ppo", "distill"]
RewardControl = Literal["none", "random"]
PARALLELISMS: tuple[str, ...] = get_args(Parallelism)
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
REWARD_CONTROLS: tuple[str, ...] = get_args(RewardControl)


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
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    parallelism: Parallelism = "jit"
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    # grpo: group-relative advantages (GRPO, Dr. GRPO, RLOO by the grpo section's options); ppo: a
    # critic and GAE (the ppo section); distill: a teacher's per-token log-probs (the distill
    # section). Same sampler, data, mesh and checkpoints.
    algorithm: Algorithm = "grpo"
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    # random: the update sees coin flips with the batch's mean reward instead of the rewards (the
    # spurious-reward control); the true rewards are still logged (reward/*) and evaluated.
    reward_control: RewardControl = "none"
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    # Multi-turn episodes with an environment (None: one completion per sample).
    environment: EnvironmentConfig | None = None
    # Staleness and the sampler's own devices (a pipelined run).
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    # A mixture-of-experts policy: routing replay and the load-balancing loss's weight.
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)

    def __post_init__(self):
        object.__setattr__(self, "rewards", tuple(self.rewards))
        choice_in("run", "parallelism", self.parallelism, PARALLELISMS)
        choice_in("run", "algorithm", self.algorithm, ALGORITHMS)
        choice_in("run", "reward_control", self.reward_control, REWARD_CONTROLS)
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
        self._check_distill()
        if self.algorithm == "ppo" and self.grpo.num_iterations > 1:
            raise ValueError("algorithm: ppo with grpo.num_iterations > 1 is not supported yet: its old values would "
                             "need a separate value pass before the updates; use num_iterations: 1")
        if (self.grpo.sampler_is_cap is not None or self.grpo.sampler_is_mask is not None) \
                and self.grpo.num_iterations > 1:
            raise ValueError(
                "grpo.sampler_is_cap with grpo.num_iterations > 1 is not supported: the ratio's old policy would be "
                "the sampler's, not the trainer's; use num_iterations: 1 with the correction, or turn it off")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: each function may appear once, got {names}")
        if self.eval.reward is not None and self.eval.reward not in names:
            raise ValueError(f"eval.reward={self.eval.reward!r} is not a configured reward; configured: {names}")
        if self.rollout.pipelined:
            self._check_pipeline()
        if self.environment is not None:
            self._check_environment()
        elif self.sft.turns:
            raise ValueError("sft.turns are the model's turns of worked episodes: set an environment, or use "
                             "sft.answer_template for single answers")
        check_micro_batches(self.data.prompts_per_step * self.sampling.group_size, self.train.micro_batches,
                            "data.prompts_per_step x sampling.group_size")
        if self.train.packing and self.algorithm == "ppo":
            raise ValueError("train.packing does not run with algorithm: ppo yet (the critic reads unpacked hidden "
                             "states); set train.packing: false")
        longest = max(self.sampling.prompt_buckets) + self.sampling.max_new_tokens
        if self.train.packing and 0 < self.train.pack_length < self.sampling.max_new_tokens + 1:
            raise ValueError(f"train.pack_length={self.train.pack_length} cannot hold one prompt token and "
                             f"sampling.max_new_tokens={self.sampling.max_new_tokens}; raise it (0 = {longest}, "
                             "every sequence fits)")

    @property
    def pack_length(self) -> int:
        """The tokens of a packing bin: train.pack_length, or (0) the longest prompt bucket +
        sampling.max_new_tokens."""
        return self.train.pack_length or max(self.sampling.prompt_buckets) + self.sampling.max_new_tokens

    def _check_distill(self) -> None:
        if self.algorithm != "distill":
            if self.distill != DistillConfig():
                raise ValueError(f"distill: {self.distill} is set, but the distill section applies only with "
                                 f"algorithm: distill (this run's algorithm is {self.algorithm})")
            return
        if self.distill.teacher is None:
            raise ValueError("algorithm: distill needs distill.teacher: the teacher's HF directory or GGUF file")
        if self.lora.enabled:
            raise ValueError("algorithm: distill with lora is not supported yet: the student trains all its weights")
        if self.parallelism != "jit":
            raise ValueError("algorithm: distill with parallelism: pmap is not supported; use parallelism: jit")

    def _check_pipeline(self) -> None:
        """What a pipelined run (rollout.staleness or rollout.sampler_devices) supports today."""
        refused = []
        if self.parallelism != "jit":
            refused.append("parallelism: pmap (use jit)")
        if self.environment is not None:
            refused.append("environment (multi-turn episodes sample on the learner's devices for now)")
        if self.algorithm != "grpo":
            refused.append(f"algorithm: {self.algorithm}")
        if refused:
            raise ValueError("rollout.staleness / rollout.sampler_devices: not supported with " + "; ".join(refused))

    def _check_environment(self) -> None:
        """What multi-turn runs support today; each refusal says what to change."""
        refused = []
        if self.algorithm != "grpo":
            refused.append(f"algorithm: {self.algorithm} (multi-turn runs use algorithm: grpo)")
        if self.sampling.engine == "static":
            refused.append("sampling.engine: static (episodes run in the slots of the continuous or paged engine: "
                           "set one of them)")
        if self.parallelism != "jit":
            refused.append("parallelism: pmap (use jit)")
        if self.train.dynamic_sampling:
            refused.append("train.dynamic_sampling (not with episodes yet)")
        if self.reward_control != "none":
            refused.append(f"reward_control: {self.reward_control}")
        if self.sampling.min_new_tokens:
            refused.append("sampling.min_new_tokens (it counts trajectory positions, not a turn's tokens)")
        if self.data.chat_template == "never":
            refused.append("data.chat_template: never (episodes are rendered with the tokenizer's chat template)")
        if refused:
            raise ValueError("environment: not supported with " + "; ".join(refused))
        if self.sft.steps and not self.sft.turns:
            raise ValueError("sft.steps > 0 with an environment needs sft.turns: the model's turns of a worked "
                             "episode (templates over the row's fields), which the environment answers")
