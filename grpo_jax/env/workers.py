"""Environments and their calls under time limits: a user environment named in the config
(`module:Class`, `path/to/file.py:Class`) lives in worker processes (grpo_jax.usercode.workers),
one instance per episode, where a call that hangs is ended with its process; a built-in one, or
one given as a Python callable, runs in the trainer's process on its bounded pool of threads
(grpo_jax.usercode.calls). Either way a call is a `Call` the episode reads when it looks."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from grpo_jax.usercode import Call, Workers, absolute_name, start_local

OPTIONAL_ATTRIBUTES = ("tools", "tool_call_end")  # what the host reads of an environment (README)


class WorkerEnvironments:
    """The factory of the user environment `name`: each call makes one `RemoteEnvironment`, whose
    instance is built in one of up to `workers` processes by its first call (`reset`)."""

    def __init__(self, name: str, kwargs: Mapping[str, Any] | None = None, *, workers: int):
        self.name = name
        self.pool = Workers(absolute_name(name), kwargs, size=workers, what="environment", member="class")
        self.keys = itertools.count()

    def __call__(self) -> RemoteEnvironment:
        return RemoteEnvironment(self.pool, next(self.keys))


class RemoteEnvironment:
    """One episode's environment in a worker process; `tools` and `tool_call_end` are the
    instance's, known once `reset` has answered."""

    tools = None
    tool_call_end = None

    def __init__(self, pool: Workers, key: int):
        self.pool, self.key = pool, key

    def start_reset(self, example: dict) -> Call:
        return self.pool.start("reset", (example,), key=self.key, make=True, attrs=OPTIONAL_ATTRIBUTES,
                               convert=self._opened)

    def _opened(self, answer):
        messages, attributes = answer
        self.tools, self.tool_call_end = attributes["tools"], attributes["tool_call_end"]
        return messages

    def start_step(self, completion: str) -> Call:
        return self.pool.start("step", (completion,), key=self.key)

    def close(self) -> None:
        self.pool.drop(self.key)


def start_reset(make_env, example: dict, opened) -> tuple[Any, Call]:
    """(the environment, or None until its local constructor ran; the call of `make_env()` and its
    `reset(example)`); `opened(env)` is told the locally built environment from the call's thread."""
    if isinstance(make_env, WorkerEnvironments):
        env = make_env()
        return env, env.start_reset(example)

    def build_and_reset():
        env = make_env()
        opened(env)
        return env.reset(example)

    return None, start_local(build_and_reset)


def start_step(env, completion: str) -> Call:
    """The environment's `step(completion)`, started now."""
    if isinstance(env, RemoteEnvironment):
        return env.start_step(completion)
    return start_local(env.step, completion)


def close(env) -> None:
    """The episode is over: a worker forgets its environment (a local one is left to the collector)."""
    if isinstance(env, RemoteEnvironment):
        env.close()
