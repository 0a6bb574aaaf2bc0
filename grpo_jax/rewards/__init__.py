"""Verifiable rewards: `fn(prompts, completions, **example_fields) -> list[float | None]`.

`REWARD_FUNCTIONS` maps the names used in configs (`rewards: [{name: ..., weight: ..., kwargs: ...}]`)
to the functions; `get_reward_fn` looks one up, or imports user code named `module:function` (an
importable module) or `path/to/file.py:function`.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

from grpo_jax.config import did_you_mean
from grpo_jax.rewards.code import code_reward, extract_code
from grpo_jax.rewards.combine import RewardFn, RewardResult, RewardSpec, combine_rewards
from grpo_jax.rewards.countdown import countdown_reward, evaluate_expression, extract_expression
from grpo_jax.rewards.format import format_reward
from grpo_jax.rewards.length import overlong_reward
from grpo_jax.rewards.llm_judge import LLMJudgeReward, parse_score
from grpo_jax.rewards.math import extract_answer, math_accuracy, parse_number, strip_echo
from grpo_jax.rewards.reward_model import RewardModelReward
from grpo_jax.sandbox import SandboxResult, run_sandboxed, sandbox_isolation

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "math_accuracy": math_accuracy,
    "format": format_reward,
    "countdown": countdown_reward,
    "code": code_reward,
    "overlong": overlong_reward,
    # A class: built once from its kwargs when the config is read (it loads a model).
    "reward_model": RewardModelReward,
    "llm_judge": LLMJudgeReward,
}


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as `name`, or user code: `package.module:function` (imported
    from sys.path, the working directory first) or `path/to/file.py:function` (relative to the
    working directory). A ValueError says what is wrong (an unknown name with the valid ones and
    the closest, a module that does not import with its error, a missing or non-callable
    attribute), so a config fails before any training starts."""
    if isinstance(name, str) and ":" in name:
        return _import_reward(name)
    try:
        return REWARD_FUNCTIONS[name]
    except (KeyError, TypeError):
        pass
    valid = sorted(REWARD_FUNCTIONS)
    raise ValueError(f"unknown reward function {name!r}{did_you_mean(name, valid)}; valid names: {', '.join(valid)}, "
                     "or your own as module:function or path/to/file.py:function")


def _import_reward(name: str) -> RewardFn:
    where, _, attr = name.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(f"reward {name!r}: write user rewards as module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"reward {name!r}: no file {str(path.resolve())!r}")
            spec = importlib.util.spec_from_file_location(f"grpo_jax_user_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # as `python -m` would: the working directory's modules
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any import error is the user's code; say which and why
        raise ValueError(f"reward {name!r}: importing {where!r} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"reward {name!r}: {where!r} has no {attr!r}{did_you_mean(attr, public)}; "
                         f"its functions: {', '.join(public) or 'none'}")
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {attr!r} in {where!r} is a {type(fn).__name__}, not a function")
    return fn


__all__ = [
    "REWARD_FUNCTIONS", "RewardFn", "RewardResult", "RewardSpec", "SandboxResult", "code_reward", "combine_rewards",
    "countdown_reward", "evaluate_expression", "extract_answer", "extract_code", "extract_expression",
    "format_reward", "get_reward_fn", "LLMJudgeReward", "parse_score", "RewardModelReward", "overlong_reward", "math_accuracy", "parse_number", "run_sandboxed", "sandbox_isolation",
    "strip_echo",
]
