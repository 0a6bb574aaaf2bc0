"""Frozen, validated run configuration. One small dataclass per concern (more arrive with the trainer)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A run's configuration; checks that span concerns live here. (The trainer's issue adds the
    model, data, train, mesh and checkpoint sections.)"""

    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)

    def __post_init__(self):
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
