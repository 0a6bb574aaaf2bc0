"""The run configuration: a leaf of the package (standard library and PyYAML only; no JAX, Flax,
optax, orbax, transformers or TFDS), so every other module imports it at module top.

`schema` holds `RunConfig` over one frozen dataclass per concern: `model` (`ModelConfig`,
`LoRAConfig`), `rollout` (`DataConfig`, `RewardConfig`, `SamplingConfig`, `EvalConfig`), `algorithm`
(`GRPOConfig`, `PPOConfig`), `training` (`TrainConfig`, `SFTConfig`, `CheckpointConfig`, `MeshConfig`,
`DistributedConfig`; `OptimizerConfig`, the optimizer a section gives), `reward_model` (the `train-rm`
run); each choice is a `Literal` and its tuple of values (`typing.get_args`), checked by `checks`.
`loading` turns YAML files and `--set` overrides into a validated `RunConfig` and back.
"""

from grpo_jax.config.algorithm import (ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, RATIO_LEVELS, SCALES, Estimator,
                                       DistillConfig, GRPOConfig, LossAggregation, PPOConfig, Scale)
from grpo_jax.config.checks import check_micro_batches
from grpo_jax.config.loading import (ConfigError, apply_overrides, config_from_dict, config_to_dict, did_you_mean,
                                     load_config, load_rm_config, unknown_key)
from grpo_jax.config.model import (ATTENTIONS, DTYPES, LORA_TARGETS, REMATS, ROUTING_REPLAYS, LoRAConfig, MoEConfig,
                                   ModelConfig)
from grpo_jax.config.reward_model import PreferenceDataConfig, RMRunConfig, RMTrainConfig
from grpo_jax.config.rollout import (DataConfig, EnvironmentConfig, EvalConfig, RewardConfig, RolloutConfig,
                                     SamplingConfig)
from grpo_jax.config.schema import RunConfig
from grpo_jax.config.training import (CheckpointConfig, DistributedConfig, LogConfig, MeshConfig, OptimizerConfig, SFTConfig,
                                      TrainConfig)

__all__ = [
    "ATTENTIONS", "DTYPES", "ESTIMATORS", "KL_ESTIMATORS", "LORA_TARGETS", "LOSS_AGGREGATIONS", "RATIO_LEVELS", "REMATS", "SCALES",
    "CheckpointConfig", "ConfigError", "DataConfig", "DistributedConfig", "EnvironmentConfig", "Estimator", "EvalConfig", "GRPOConfig",
    "DistillConfig", "LogConfig", "LoRAConfig", "MoEConfig", "ROUTING_REPLAYS", "LossAggregation", "MeshConfig", "ModelConfig", "OptimizerConfig", "PPOConfig", "RewardConfig", "RolloutConfig", "RunConfig",
    "SamplingConfig", "Scale", "SFTConfig", "TrainConfig", "apply_overrides", "check_micro_batches", "config_from_dict",
    "config_to_dict", "did_you_mean", "load_config", "load_rm_config", "unknown_key", "PreferenceDataConfig",
    "RMRunConfig", "RMTrainConfig",
]
