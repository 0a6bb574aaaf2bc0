"""Several reward functions combined with weights, each scored and logged on its own.

A function that raises is not allowed to stop the run, nor to cost the samples it did not fail on:
when its call on the whole batch raises, it is called again on each sample alone (that sample's
prompt, completion and example fields), and only the samples that raise on their own become None
(dropped from the loss); they are counted and the first one's message is kept for the log. So one
odd completion (a 400-digit number, a megabyte of tags) costs that sample only, and a function that
raises on every sample costs one more call per sample. A function that returns the wrong number of
values, or a value that is neither a finite number nor None, is a bug and raises at once, naming
the function. A finite value beyond the loss's float32 (1e300) fails its sample alone, counted
with the function's failures, and a weighted total beyond it drops its sample.

A user function named in the config (grpo_jax.usercode.UserFunction) runs in worker processes,
each call within its `timeout_s`: a batch call past it (or raising) is retried on each sample
alone, all of them side by side, so the samples that time out alone cost themselves and the step
waits about two time limits at most; a call the stopping run gives up on (CallStopped) drops the
batch's samples without a retry. A user's StatefulReward, in the trainer's process, is retried one
sample after the other: after a sample's time limit the samples left are dropped with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from grpo_jax.usercode import CallStopped, CallTimeout, UserFunction

LOSS_DTYPE = np.float32  # what the loss reads rewards as: a value must be finite in it
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
        column, beyond = _column(spec, values)
        if beyond:
            i = beyond[0]
            lost += len(beyond)
            message = message or (f"returned {values[i]!r} for sample {i}, beyond {np.dtype(LOSS_DTYPE).name} (the "
                                  "loss's dtype): the sample is dropped")
        if lost:
            failures[spec.name], messages[spec.name] = lost, message
        per_fn[spec.name] = column.astype(LOSS_DTYPE)
        total += spec.weight * column  # NaN (None) propagates: the sample is dropped
    with np.errstate(over="ignore"):
        total = total.astype(LOSS_DTYPE)
    total[np.isinf(total)] = np.nan  # a weighted total beyond float32: dropped (reward/dropped)
    return RewardResult(total=total, per_fn=per_fn, failures=failures, messages=messages)


def _scores(spec: RewardSpec, prompts: Sequence[str], completions: Sequence[str],
            fields: Mapping[str, Sequence]) -> tuple[list, int, str]:
    """(one value per completion, the samples lost to exceptions, the first exception's message).

    The batch is scored in one call; when that raises, each sample is scored alone and only the
    samples that raise alone are None. A wrong number of values is a bug, never retried."""
    n = len(completions)
    try:
        values = list(spec.fn(prompts, completions, **fields))
    except Exception as e:  # noqa: BLE001 - a failing reward drops its samples, it does not stop the run
        if n == 1 or isinstance(e, CallStopped):
            return [None] * n, n, f"{type(e).__name__}: {e}"
        values = None
    if values is not None:
        return _counted(spec, values, n), 0, ""
    values, lost, message, first = [], 0, "", None
    for i, outcome in enumerate(_each(spec.fn, prompts, completions, fields)):
        if isinstance(outcome, Exception):  # this sample only
            values.append(None)
            lost += 1
            message = message or f"{type(outcome).__name__}: {outcome}"
            first = first if first is not None else i
            continue
        values += _counted(spec, list(outcome), 1)
    if lost < n:  # some samples scored: say where the first failure was
        message = f"{message} (sample {first})"
    return values, lost, message


def _each(fn, prompts: Sequence[str], completions: Sequence[str], fields: Mapping[str, Sequence]) -> list:
    """Each sample scored alone -> per sample the values or the exception: a user function's calls
    side by side in its workers, any other one after the other in this thread."""
    one = [((prompts[i:i + 1], completions[i:i + 1]), {key: column[i:i + 1] for key, column in fields.items()})
           for i in range(len(completions))]
    if isinstance(fn, UserFunction):
        return fn.each(one)
    # A reward that keeps statistics (grpo_jax.rewards.stateful: a reward model's running
    # normalisation) rescores without updating them: one failed batch must not count n times.
    fn = fn.without_updates() if callable(getattr(fn, "without_updates", None)) else fn
    out, late = [], None
    for args, kwargs in one:
        if late is not None:  # one after the other, a second time limit per sample is not waited for
            out.append(late)
            continue
        try:
            out.append(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - this sample only
            out.append(e)
            late = e if isinstance(e, CallTimeout) else None
    return out


def _column(spec: RewardSpec, values: list) -> tuple[np.ndarray, list[int]]:
    """(float64 values, NaN for None and for the finite values beyond the loss's dtype; those
    samples); anything but a finite number or None is a bug, named."""
    column, beyond = np.empty(len(values), np.float64), []
    limit = float(np.finfo(LOSS_DTYPE).max)
    for i, v in enumerate(values):
        column[i] = np.nan
        if v is None:
            continue
        number = isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
        try:
            value = float(v) if number else math.nan
        except OverflowError:  # an int beyond float64: finite, and beyond float32 too
            value = math.inf
        if number and isinstance(v, (int, np.integer)) and math.isinf(value) or math.isfinite(value) and abs(value) > limit:
            beyond.append(i)
        elif not math.isfinite(value):
            raise ValueError(f"reward function {spec.name!r} returned {v!r} for sample {i}; return a finite number, "
                             "or None when the sample cannot be judged")
        else:
            column[i] = value
    return column, beyond


def _counted(spec: RewardSpec, values: list, n: int) -> list:
    if len(values) != n:
        raise ValueError(f"reward function {spec.name!r} returned {len(values)} values for {n} completions")
    return values
