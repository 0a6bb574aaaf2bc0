"""Verifiable rewards: `fn(prompts, completions, **example_fields) -> list[float | None]`."""

from grpo_jax.rewards.combine import RewardResult, RewardSpec, combine_rewards
from grpo_jax.rewards.math import extract_answer, math_accuracy, parse_number

__all__ = ["RewardResult", "RewardSpec", "combine_rewards", "extract_answer", "math_accuracy", "parse_number"]
