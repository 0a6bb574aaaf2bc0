"""Several reward functions combined with weights, each scored and logged on its own.

A function that raises is not allowed to stop the run or to score anything: its samples become
None (dropped from the loss), the failure is counted and its first message kept for the log. A
function that returns the wrong number of values, or a value that is neither a finite number nor
None, is a bug and raises at once, naming the function.
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
        try:
            values = list(spec.fn(prompts, completions, **fields))
        except Exception as e:  # noqa: BLE001 - a failing reward drops its samples, it does not stop the run
            values = [None] * n
            failures[spec.name] = n
            messages[spec.name] = f"{type(e).__name__}: {e}"
        if len(values) != n:
            raise ValueError(f"reward function {spec.name!r} returned {len(values)} values for {n} completions")
        column = np.empty(n, np.float64)
        for i, v in enumerate(values):
            if v is None:
                column[i] = np.nan
            elif isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) and math.isfinite(v):
                column[i] = float(v)
            else:
                raise ValueError(
                    f"reward function {spec.name!r} returned {v!r} for sample {i}; return a finite number, "
                    "or None when the sample cannot be judged")
        per_fn[spec.name] = column.astype(np.float32)
        total += spec.weight * column  # NaN (None) propagates: the sample is dropped
    return RewardResult(total=total.astype(np.float32), per_fn=per_fn, failures=failures, messages=messages)
