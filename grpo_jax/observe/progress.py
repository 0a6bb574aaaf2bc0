"""The terminal progress bar of a run (tqdm): step/total, reward, last eval accuracy, KL, tokens/s, ETA."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from grpo_jax.observe.writers import Closing, format_value


def _first(metrics: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for k in keys:
        if k in metrics:
            return metrics[k]
    return None


class ProgressBar(Closing):
    """A terminal progress bar (tqdm): step/total, reward, last eval accuracy, KL, tokens/s, ETA.

    It shows only when `enabled` and the stream (`file`, default stderr) is a terminal, unless
    `tty_only=False`; otherwise every method does nothing. `update` never raises on missing or NaN
    metrics: they are shown as `-` and `nan`.
    """

    def __init__(self, total_steps: int, *, enabled: bool = True, initial: int = 0,
                 file: TextIO | None = None, tty_only: bool = True):
        if total_steps < 0 or not 0 <= initial <= total_steps:
            raise ValueError(f"need 0 <= initial ({initial}) <= total_steps ({total_steps})")
        file = sys.stderr if file is None else file
        try:
            is_tty = file.isatty()
        except (AttributeError, ValueError):  # a closed or file-like stream without isatty
            is_tty = False
        self.enabled = bool(enabled) and (is_tty or not tty_only)
        self._accuracy: Any = None
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            # mininterval=0: steps take seconds, so redrawing on every update costs nothing.
            self._bar = tqdm(total=total_steps, initial=initial, file=file, unit="step",
                             dynamic_ncols=True, mininterval=0, leave=True)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move the bar to `step` (steps completed so far) and show the headline metrics."""
        if self._bar is None:
            return
        metrics = metrics or {}
        if "eval/accuracy" in metrics:
            self._accuracy = metrics["eval/accuracy"]
        fields = [("reward", _first(metrics, ("reward/mean",))), ("acc", self._accuracy),
                  ("kl", _first(metrics, ("kl/k3", "kl/k1"))),
                  ("tok/s", _first(metrics, ("perf/sample_tokens_per_s", "perf/train_tokens_per_s")))]
        self._bar.set_postfix_str(" | ".join(f"{k} {'-' if v is None else format_value(v)}" for k, v in fields),
                                  refresh=False)
        delta = int(step) - self._bar.n
        if delta > 0:
            self._bar.update(delta)
        else:
            self._bar.n = int(step)
            self._bar.refresh()

    def write(self, message: str) -> None:
        """Print a line above the bar (or plainly to stderr when the bar is off)."""
        if self._bar is None:
            print(message, file=sys.stderr)
        else:
            self._bar.write(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
