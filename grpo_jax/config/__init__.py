"""The run configuration: a leaf of the package (standard library and PyYAML only; no JAX, Flax,
optax, orbax, transformers or TFDS), so every other module imports it at module top.

`schema` holds one frozen dataclass per concern (`SamplingConfig`, `GRPOConfig`, `MeshConfig`, ...,
and `RunConfig` over them); `loading` turns YAML files and `--set` overrides into a validated
`RunConfig` and back.
"""

from grpo_jax.config.loading import (ConfigError, apply_overrides, config_from_dict, config_to_dict, did_you_mean,
                                     load_config, load_rm_config, unknown_key)
from grpo_jax.config.reward_model import PreferenceDataConfig, RMRunConfig, RMTrainConfig
from grpo_jax.config.schema import (DTYPES, ESTIMATORS, KL_ESTIMATORS, LORA_TARGETS, LOSS_AGGREGATIONS, RATIO_LEVELS,
                                    SCALES, CheckpointConfig, DataConfig, DistributedConfig, Estimator, EvalConfig,
                                    GRPOConfig, LoRAConfig, LossAggregation, MeshConfig, ModelConfig, PPOConfig,
                                    RewardConfig, RunConfig, SamplingConfig, Scale, SFTConfig, TrainConfig,
                                    check_micro_batches)

__all__ = [
    "DTYPES", "ESTIMATORS", "KL_ESTIMATORS", "LORA_TARGETS", "LOSS_AGGREGATIONS", "RATIO_LEVELS", "SCALES",
    "CheckpointConfig", "ConfigError", "DataConfig", "DistributedConfig", "Estimator", "EvalConfig", "GRPOConfig",
    "LoRAConfig", "LossAggregation", "MeshConfig", "ModelConfig", "PPOConfig", "RewardConfig", "RunConfig",
    "SamplingConfig", "Scale", "SFTConfig", "TrainConfig", "apply_overrides", "check_micro_batches", "config_from_dict",
    "config_to_dict", "did_you_mean", "load_config", "load_rm_config", "unknown_key", "PreferenceDataConfig",
    "RMRunConfig", "RMTrainConfig",
]
