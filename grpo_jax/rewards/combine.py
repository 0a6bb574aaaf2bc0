"""Several reward functions combined with weights, each scored and logged on its own.

A function that raises is not allowed to stop the run, nor to cost the samples it did not fail on:
when its call on the whole batch raises, it is called again on each sample alone (that sample's
prompt, completion and example fields), and only the samples that raise on their own become None
(dropped from the loss); they are counted and the first one's message is kept for the log. So one
odd completion (a 400-digit number, a megabyte of tags) costs that sample only, and a function that
raises on every sample costs one more call per sample. A function that returns the wrong number of
values, or a value that is neither a finite number nor None, is a bug and raises at once, naming
the function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

RewardFn = Callable[..., Sequence[float | None]]


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    name: str
    fn: RewardFn
    weight: float = 1.0


@dataclasses.dataclass
class RewardResult:
    total: np.ndarray  # float32 [n]; NaN where any weighted function returned None (sample dropped)
    per_fn: dict[str, np.ndarray]  # float32 [n] per function; NaN for None
    failures: dict[str, int]  # samples lost to exceptions, per function
    messages: dict[str, str]  # first exception message per failing function

    def metrics(self) -> dict[str, float]:
        """`reward/<fn>/mean` over the samples each function could judge, and `reward/<fn>/unjudged`:
        the samples it returned None for (not those lost to an exception, counted in `failures`)."""
        out = {}
        for name, values in self.per_fn.items():
            judged = values[~np.isnan(values)]
            out[f"reward/{name}/mean"] = float(judged.mean()) if judged.size else float("nan")
            out[f"reward/{name}/unjudged"] = float(values.size - judged.size - self.failures.get(name, 0))
        return out


def combine_rewards(specs: Sequence[RewardSpec], prompts: Sequence[str], completions: Sequence[str],
                    example_fields: Mapping[str, Sequence] | None = None) -> RewardResult:
    if not specs:
        raise ValueError("no reward functions configured")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"reward function names must be unique, got {names}")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts but {n} completions")
    fields = dict(example_fields or {})
    for key, values in fields.items():
        if len(values) != n:
            raise ValueError(f"example field {key!r} has {len(values)} values for {n} completions")
    total = np.zeros(n, np.float64)
    per_fn, failures, messages = {}, {}, {}
    for spec in specs:
        values, lost, message = _scores(spec, prompts, completions, fields)
        if lost:
            failures[spec.name], messages[spec.name] = lost, message
        column = _column(spec, values)
        per_fn[spec.name] = column.astype(np.float32)
        total += spec.weight * column  # NaN (None) propagates: the sample is dropped
    return RewardResult(total=total.astype(np.float32), per_fn=per_fn, failures=failures, messages=messages)


def _scores(spec: RewardSpec, prompts: Sequence[str], completions: Sequence[str],
            fields: Mapping[str, Sequence]) -> tuple[list, int, str]:
    """(one value per completion, the samples lost to exceptions, the first exception's message).

    The batch is scored in one call; when that raises, each sample is scored alone and only the
    samples that raise alone are None. A wrong number of values is a bug, never retried."""
    n = len(completions)
    try:
        values = list(spec.fn(prompts, completions, **fields))
    except Exception as e:  # noqa: BLE001 - a failing reward drops its samples, it does not stop the run
        if n == 1:
            return [None], 1, f"{type(e).__name__}: {e}"
        values = None
    if values is not None:
        return _counted(spec, values, n), 0, ""
    values, lost, message, first = [], 0, "", None
    # A reward that keeps statistics (grpo_jax.rewards.stateful: a reward model's running
    # normalisation) rescores without updating them: one failed batch must not count n times.
    fn = spec.fn.without_updates() if callable(getattr(spec.fn, "without_updates", None)) else spec.fn
    for i in range(n):
        one = {key: column[i:i + 1] for key, column in fields.items()}
        try:
            value = list(fn(prompts[i:i + 1], completions[i:i + 1], **one))
        except Exception as e:  # noqa: BLE001 - this sample only
            values.append(None)
            lost += 1
            message = message or f"{type(e).__name__}: {e}"
            first = first if first is not None else i
            continue
        values += _counted(spec, value, 1)
    if lost < n:  # some samples scored: say where the first failure was
        message = f"{message} (sample {first})"
    return values, lost, message


def _column(spec: RewardSpec, values: list) -> np.ndarray:
    """float64 values, NaN for None; anything but a finite number or None is a bug, named."""
    column = np.empty(len(values), np.float64)
    for i, v in enumerate(values):
        if v is None:
            column[i] = np.nan
            continue
        number = isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
        try:
            column[i] = float(v) if number else np.nan
        except OverflowError:  # an int beyond float range
            column[i] = np.nan
        if not math.isfinite(column[i]):
            raise ValueError(f"reward function {spec.name!r} returned {v!r} for sample {i}; return a finite number, "
                             "or None when the sample cannot be judged")
    return column


def _counted(spec: RewardSpec, values: list, n: int) -> list:
    if len(values) != n:
        raise ValueError(f"reward function {spec.name!r} returned {len(values)} values for {n} completions")
    return values
