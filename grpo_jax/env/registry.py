"""Environments by name: a built-in (`BUILT_IN`), `module:Class` or `path/to/file.py:Class` (run in
worker processes: `environment_maker`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from grpo_jax.env.calculator import Calculator
from grpo_jax.env.countdown import CountdownFeedback
from grpo_jax.env.python_tool import PythonTool
from grpo_jax.env.tool_calls import template_tool_format
from grpo_jax.env.workers import WorkerEnvironments
from grpo_jax.usercode import is_user_name, load_user_object

BUILT_IN: dict[str, type] = {"calculator": Calculator, "countdown": CountdownFeedback, "python": PythonTool}


def environment_factory(name: str, kwargs: Mapping[str, Any] | None = None, tokenizer=None) -> Callable[[], Any]:
    """A callable that makes one environment per episode, `cls(**kwargs)`; ValueError when `name`
    names no class with `reset` and `step`, or `kwargs` do not fit its constructor. A built-in tool
    environment's `tool_format` (unset or `auto`) follows `tokenizer`'s chat template
    (grpo_jax.env.tool_calls)."""
    kwargs = dict(kwargs or {})
    cls = BUILT_IN.get(name) or load_user_object(name, what="environment", member="class")
    if name in BUILT_IN and "tool_format" in inspect.signature(cls).parameters \
            and kwargs.get("tool_format", "auto") == "auto":
        kwargs["tool_format"] = template_tool_format(tokenizer) if tokenizer is not None else "tags"
    if not inspect.isclass(cls):
        raise ValueError(f"environment {name!r} is a {type(cls).__name__}; expected a class with reset() and step()")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {name!r} ({cls.__name__}) has no {' or '.join(missing)} method; "
                         "an environment needs reset(example) -> messages and step(completion) -> EnvStep")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"environment {name!r}: environment.kwargs do not fit {cls.__name__}(): {e}") from None
    return functools.partial(cls, **kwargs)


def environment_maker(name: str, kwargs: Mapping[str, Any] | None = None, tokenizer=None, *,
                      workers: int = 0) -> Callable[[], Any]:
    """`environment_factory`'s checks, then the run's maker of environments: a user environment
    (`module:Class`, `path/to/file.py:Class`) in up to `workers` worker processes
    (grpo_jax.env.workers), or with `workers` 0, and a built-in always, the factory itself (in
    the trainer's process)."""
    factory = environment_factory(name, kwargs, tokenizer)
    if workers > 0 and is_user_name(name) and name not in BUILT_IN:
        return WorkerEnvironments(name, kwargs, workers=workers)
    return factory
