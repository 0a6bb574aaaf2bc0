"""A run's progress: on a terminal a bar (tqdm) with step/total, reward, last eval accuracy, KL,
tokens/s and ETA; off one (nohup, a pod's log file) the same as one line per `every` steps."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from grpo_jax.observe.writers import Closing, format_value


# (label, metric keys: the first present is shown, kept: whether a step without them shows the last
# value (a held-out accuracy, measured every eval.every steps) rather than `-`).
POLICY_FIELDS = (("reward", ("reward/mean",), False), ("acc", ("eval/accuracy",), True),
                 ("kl", ("kl/k3", "kl/k1"), False),
                 ("tok/s", ("perf/sample_tokens_per_s", "perf/train_tokens_per_s"), False))


class ProgressBar(Closing):
    """A terminal progress bar (tqdm): step/total, reward, last eval accuracy, KL, tokens/s, ETA.

    It shows when `enabled` and the stream (`file`, default stderr) is a terminal (or
    `tty_only=False`). Enabled off a terminal, it writes one line every `every` steps instead
    (`step 40/400 | reward 0.412 | acc 0.520 | kl 0.0031 | tok/s 1,234 | 3.21 s/step | ETA 0:19:16`;
    `every=0`: none). Seconds per step are the mean of the last ten steps' wall time; the ETA is
    that times the steps left. `update` never raises on missing or NaN metrics: they are shown as
    `-` and `nan`. `start`: the metrics known before the first update (an evaluation's). `fields`:
    what is shown, as (label, metric keys, kept) (default: a policy run's, POLICY_FIELDS).
    """

    def __init__(self, total_steps: int, *, enabled: bool = True, initial: int = 0,
                 file: TextIO | None = None, tty_only: bool = True, every: int = 1,
                 start: Mapping[str, Any] | None = None,
                 fields: Sequence[tuple[str, Sequence[str], bool]] = POLICY_FIELDS):
        if total_steps < 0 or not 0 <= initial <= total_steps:
            raise ValueError(f"need 0 <= initial ({initial}) <= total_steps ({total_steps})")
        file = sys.stderr if file is None else file
        try:
            is_tty = file.isatty()
        except (AttributeError, ValueError):  # a closed or file-like stream without isatty
            is_tty = False
        self.enabled = bool(enabled) and (is_tty or not tty_only)
        self._lines = bool(enabled) and not self.enabled and every > 0
        self._file, self._every, self._total, self._n = file, int(every), total_steps, initial
        self._times: list[float] = []
        self._last = time.perf_counter()
        self._spec = tuple((label, tuple(keys), bool(kept)) for label, keys, kept in fields)
        self._shown: dict[str, Any] = {}
        self._fields(start or {})  # the metrics before the first step (the step-0 evaluation's accuracy)
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            # mininterval=0: steps take seconds, so redrawing on every update costs nothing.
            self._bar = tqdm(total=total_steps, initial=initial, file=file, unit="step",
                             dynamic_ncols=True, mininterval=0, leave=True)

    def _fields(self, metrics: Mapping[str, Any]) -> list[tuple[str, Any]]:
        for label, keys, kept in self._spec:
            present = [k for k in keys if k in metrics]
            if present or not kept:
                self._shown[label] = metrics[present[0]] if present else None
        return [(label, self._shown.get(label)) for label, _, _ in self._spec]

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move the bar to `step` (steps completed so far) and show the headline metrics."""
        metrics = metrics or {}
        if self._lines:
            self._line(int(step), metrics)
        if self._bar is None:
            return
        self._bar.set_postfix_str(" | ".join(f"{k} {'-' if v is None else format_value(v)}"
                                             for k, v in self._fields(metrics)), refresh=False)
        delta = int(step) - self._bar.n
        if delta > 0:
            self._bar.update(delta)
        else:
            self._bar.n = int(step)
            self._bar.refresh()

    def _line(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        if step > self._n:
            self._times = [*self._times, (now - self._last) / (step - self._n)][-10:]
        self._n, self._last = step, now
        fields = self._fields(metrics)
        if step % self._every and step != self._total:
            return
        per_step = sum(self._times) / len(self._times) if self._times else None
        eta = "-" if per_step is None else str(datetime.timedelta(seconds=round(per_step * (self._total - step))))
        cells = [f"step {step}/{self._total}", *(f"{k} {'-' if v is None else format_value(v)}" for k, v in fields),
                 f"{'-' if per_step is None else f'{per_step:.2f}'} s/step", f"ETA {eta}"]
        print(" | ".join(cells), file=self._file, flush=True)

    def write(self, message: str) -> None:
        """Print a line above the bar (or plainly to the stream when the bar is off)."""
        if self._bar is None:
            print(message, file=self._file)
        else:
            self._bar.write(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
