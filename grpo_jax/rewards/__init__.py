"""Verifiable rewards: `fn(prompts, completions, **example_fields) -> list[float | None]`.

`REWARD_FUNCTIONS` maps the names used in configs (`rewards: [{name: ..., weight: ..., kwargs: ...}]`)
to the functions; `get_reward_fn` looks one up.
"""

from grpo_jax.config import did_you_mean
from grpo_jax.rewards.code import code_reward, extract_code
from grpo_jax.rewards.combine import RewardFn, RewardResult, RewardSpec, combine_rewards
from grpo_jax.rewards.countdown import countdown_reward, evaluate_expression, extract_expression
from grpo_jax.rewards.format import format_reward
from grpo_jax.rewards.length import overlong_reward
from grpo_jax.rewards.math import extract_answer, math_accuracy, parse_number, strip_echo
from grpo_jax.sandbox import SandboxResult, run_sandboxed, sandbox_isolation

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "math_accuracy": math_accuracy,
    "format": format_reward,
    "countdown": countdown_reward,
    "code": code_reward,
    "overlong": overlong_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as `name`; a ValueError naming the valid names (and the
    closest one) otherwise, so a typo in a config fails before any training starts."""
    try:
        return REWARD_FUNCTIONS[name]
    except (KeyError, TypeError):
        pass
    valid = sorted(REWARD_FUNCTIONS)
    raise ValueError(f"unknown reward function {name!r}{did_you_mean(name, valid)}; valid names: {', '.join(valid)}")


__all__ = [
    "REWARD_FUNCTIONS", "RewardFn", "RewardResult", "RewardSpec", "SandboxResult", "code_reward", "combine_rewards",
    "countdown_reward", "evaluate_expression", "extract_answer", "extract_code", "extract_expression",
    "format_reward", "get_reward_fn", "overlong_reward", "math_accuracy", "parse_number", "run_sandboxed", "sandbox_isolation",
    "strip_echo",
]
