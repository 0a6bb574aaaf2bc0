"""Building rewards from a config: the registry of built-in names, user code named
`module:function` or `path/to/file.py:function`, and the one check of a reward's configured
options (`check_options`), for functions and for classes built once (`StatefulReward`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from grpo_jax.config import ConfigError, RunConfig, did_you_mean
from grpo_jax.rewards.code import check_isolation, code_reward
from grpo_jax.rewards.combine import RewardFn, RewardSpec
from grpo_jax.rewards.countdown import countdown_reward
from grpo_jax.rewards.format import format_reward
from grpo_jax.rewards.length import overlong_reward
from grpo_jax.rewards.llm_judge import LLMJudgeReward
from grpo_jax.rewards.math import math_accuracy
from grpo_jax.rewards.reward_model import RewardModelReward
from grpo_jax.rewards.stateful import StatefulReward, TimedReward
from grpo_jax.sandbox import sandbox_shared
from grpo_jax.usercode import UserFunction, is_user_name, load_user_object

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
    return import_user_object(name, what="reward")


def import_user_object(name: str, *, what: str, member: str = "function"):
    """The object `name` points at (grpo_jax.usercode.load_user_object)."""
    return load_user_object(name, what=what, member=member)


def unwrapped(fn) -> tuple[Any, dict]:
    """(the function, its bound keywords) of a reward that may be a functools.partial."""
    if isinstance(fn, functools.partial):
        return fn.func, dict(fn.keywords)
    return fn, {}


def check_options(fn, kwargs: Mapping[str, Any], where: str, *, required: bool = False) -> None:
    """Every configured keyword is a named parameter of `fn` after (prompts, completions) (a
    class's constructor: all of them), since a function's **kwargs takes the dataset's example
    fields and a misspelled option would vanish into it; `required`: every parameter without a
    default is configured. A ConfigError names the option and lists the valid ones."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin or C function without a signature: nothing to check against
    if not isinstance(fn, type):
        params = params[2:]
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    label = getattr(fn, "__name__", repr(fn))
    unknown = [k for k in kwargs if k not in named]
    if unknown:
        raise ConfigError(f"{where}: {unknown[0]!r} is not an option of reward {label}"
                          f"{did_you_mean(unknown[0], named)}; its options: {', '.join(named) or 'none'}")
    missing = [p.name for p in params if required and p.default is p.empty and p.name in named and p.name not in kwargs]
    if missing:
        raise ConfigError(f"{where}: reward {label} needs {', '.join(missing)}")


def build_spec(name: str, kwargs: Mapping[str, Any], weight: float, where: tuple[str, str], *,
               generate=None, timeout_s: float = 120.0) -> RewardSpec:
    """One configured reward; `where`: the config paths of its name and of its kwargs; `generate`:
    the actor's generation function, for a reward class that declares a `generate` keyword (the
    `llm_judge`), so rewards/ never imports the sampler. A user function (`module:function`) is
    checked here and called in worker processes, each call within `timeout_s`
    (grpo_jax.usercode.UserFunction)."""
    try:
        fn = get_reward_fn(name)
    except ValueError as e:
        raise ConfigError(f"{where[0]}: {e}") from None
    if not isinstance(fn, type):
        check_options(fn, kwargs, where[1])
        if is_user_name(name):
            return RewardSpec(name=name, fn=UserFunction(name, kwargs, timeout_s=timeout_s), weight=weight)
        return RewardSpec(name=name, fn=functools.partial(fn, **kwargs) if kwargs else fn, weight=weight)
    # A reward that holds something (a reward model), built once: an unknown option, a missing one
    # or a bad path is a ConfigError before anything trains.
    check_options(fn, kwargs, where[1], required=True)
    if "generate" in kwargs:
        raise ConfigError(f"{where[1]}: generate is the run's own generation function, not an option")
    if "generate" in inspect.signature(fn).parameters:
        kwargs = {**kwargs, "generate": generate}
    try:
        built = fn(**kwargs)
    except (ValueError, OSError, TypeError) as e:
        raise ConfigError(f"{where[1]}: {type(e).__name__}: {e}") from None
    if not isinstance(built, StatefulReward):
        raise ConfigError(f"{where[0]}: {fn.__name__} is a class but not a StatefulReward (place, state_dict, "
                          "load_state_dict, without_updates); register a function or implement those")
    return RewardSpec(name=name, fn=TimedReward(built, timeout_s) if is_user_name(name) else built, weight=weight)


def build_rewards(config: RunConfig, *, generate=None) -> tuple[list[RewardSpec], RewardSpec, RewardSpec | None]:
    """(the training rewards, the one evaluation judges correctness by, eval.verifier's or None);
    `generate`: the actor's generation function for rewards that write (`build_spec`)."""
    if not config.rewards:
        raise ConfigError("rewards: configure at least one reward function, e.g. rewards: [{name: math_accuracy}]")
    specs = [build_spec(r.name, r.kwargs, r.weight, (f"rewards[{i}].name", f"rewards[{i}].kwargs"), generate=generate,
                        timeout_s=r.timeout_s) for i, r in enumerate(config.rewards)]
    name = config.eval.reward or specs[0].name
    e = config.eval
    verifier = None if e.verifier is None else build_spec(e.verifier, e.verifier_kwargs, 1.0,
                                                          ("eval.verifier", "eval.verifier_kwargs"), generate=generate)
    return specs, next(s for s in specs if s.name == name), verifier


def sandbox_notes(specs: list[RewardSpec]) -> list[str]:
    """The code reward's sandbox isolation as lines to log, checked before the run starts: without
    user, mount and PID namespaces it is refused unless its kwargs say allow_weak_isolation. Each
    line ends with what a sample could write that the host and later samples see ("nothing")."""
    notes = []
    for index, spec in enumerate(specs):
        fn, kwargs = unwrapped(spec.fn)
        if fn is not code_reward:
            continue
        try:
            line = check_isolation(allow_weak_isolation=kwargs.get("allow_weak_isolation", False),
                                   python=kwargs.get("python"))
        except ValueError as e:
            raise ConfigError(f"rewards[{index}] ({spec.name}): {e}") from None
        shared = sandbox_shared(kwargs.get("python"))
        notes.append(f"{line}; writable and shared with the host: {'; '.join(shared) or 'nothing'}")
    return notes
