"""Verifiable rewards: `fn(prompts, completions, **example_fields) -> list[float | None]`.

`REWARD_FUNCTIONS` maps the names used in configs (`rewards: [{name: ..., weight: ..., kwargs: ...}]`)
to the functions; `get_reward_fn` looks one up, or imports user code named `module:function` (an
importable module) or `path/to/file.py:function` (grpo_jax.rewards.registry, which also builds a
config's rewards and checks their options).
"""

from grpo_jax.rewards.code import code_reward, extract_code
from grpo_jax.rewards.combine import RewardFn, RewardResult, RewardSpec, combine_rewards
from grpo_jax.rewards.countdown import countdown_reward, evaluate_expression, extract_expression
from grpo_jax.rewards.format import format_reward
from grpo_jax.rewards.stateful import RewardStates, StatefulReward
from grpo_jax.rewards.length import overlong_reward
from grpo_jax.rewards.llm_judge import LLMJudgeReward, parse_score
from grpo_jax.rewards.math import extract_answer, math_accuracy, parse_number, strip_echo
from grpo_jax.rewards.reward_model import RewardModelReward
from grpo_jax.rewards.registry import (REWARD_FUNCTIONS, build_rewards, build_spec, check_options, get_reward_fn,
                                      unwrapped)
from grpo_jax.sandbox import SandboxResult, run_sandboxed, sandbox_isolation

__all__ = [
    "REWARD_FUNCTIONS", "RewardFn", "RewardStates", "StatefulReward", "build_rewards", "build_spec", "check_options", "unwrapped", "RewardResult", "RewardSpec", "SandboxResult", "code_reward", "combine_rewards",
    "countdown_reward", "evaluate_expression", "extract_answer", "extract_code", "extract_expression",
    "format_reward", "get_reward_fn", "LLMJudgeReward", "parse_score", "RewardModelReward", "overlong_reward", "math_accuracy", "parse_number", "run_sandboxed", "sandbox_isolation",
    "strip_echo",
]
