"""A user function named in the config (a reward's `module:function`) called in worker processes
(grpo_jax.usercode.workers) under a time limit: the call raises what the function raised,
CallTimeout past `timeout_s`, or CallStopped when the run is stopping."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo_jax.usercode.loading import absolute_name
from grpo_jax.usercode.workers import Workers


class UserFunction:
    """`fn(*args, **kwargs)` of the function `name` with `kwargs` bound, run in up to `workers`
    processes, each call within `timeout_s`."""

    def __init__(self, name: str, kwargs: Mapping[str, Any] | None = None, *, timeout_s: float, workers: int = 2,
                 what: str = "reward"):
        if not timeout_s > 0:
            raise ValueError(f"{what} {name!r}: timeout_s must be > 0, got {timeout_s}")
        self.name, self.timeout_s = name, float(timeout_s)
        self.workers = Workers(absolute_name(name), kwargs, size=workers, what=what, member="function")

    def __call__(self, *args, **kwargs):
        return self.workers.start(None, args, kwargs).result(self.timeout_s)

    def each(self, calls: Sequence[tuple[tuple, dict]]) -> list:
        """Every (args, kwargs) of `calls` started together -> per call its value or the exception
        it ended with (each within `timeout_s`, so all of them within about `timeout_s`)."""
        started = [self.workers.start(None, args, kwargs) for args, kwargs in calls]
        out: list = []
        for call in started:
            try:
                out.append(call.result(self.timeout_s))
            except Exception as e:  # noqa: BLE001 - this call's outcome
                out.append(e)
        return out

    def __repr__(self) -> str:
        return f"UserFunction({self.name!r}, timeout_s={self.timeout_s:g})"
