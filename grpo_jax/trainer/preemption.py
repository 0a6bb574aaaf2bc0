"""Preemption: a preemption notice (SIGTERM) or Ctrl-C (SIGINT) ends the current step, saves a
checkpoint at it and lets the run return normally; a second signal aborts at once.

On one host the trainer's own signal handlers set the flag. On several hosts (jax.distributed)
JAX's preemption service already owns SIGTERM: it agrees on a step every host reaches
(`multihost_utils.reached_preemption_sync_point`), so every host saves the same step; SIGINT is
still ours, and a flag set on any host stops every host at the same step (one small collective
per step, shared with the wall-clock checkpoint decision).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from jax.experimental import multihost_utils

from grpo_jax.runtime.hosts import any_hosts, multi_process


def _jax_preemption_service() -> bool:
    """True when jax.distributed runs its preemption service (it then handles SIGTERM itself)."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - a JAX without the module: no service to defer to
        return False
    return distributed.global_state.preemption_sync_manager is not None


class StopSignals:
    """Context manager installing the handlers (main thread only; restored on exit), and the
    per-step decision `check(step)` -> (stop, checkpoint due by the clock), the same on every host."""

    def __init__(self, log: Callable[[str], None], *, every_minutes: float = 0.0):
        self.log = log
        self.every_s = every_minutes * 60.0
        self.received: str | None = None  # the signal's name, once one arrived (on this host)
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}
        self._jax_service = multi_process() and _jax_preemption_service()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            signals = [signal.SIGINT] + ([] if self._jax_service else [signal.SIGTERM])
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # the second signal: stop now, without saving
            signal.signal(signum, signal.SIG_DFL)
            self.log(f"received {name} again: aborting now, without a checkpoint")
            os.kill(os.getpid(), signum)
            return
        self.received = name
        self.log(f"received {name}: finishing this step, then saving a checkpoint and stopping "
                 f"(send {name} again to abort at once)")

    def saved(self) -> None:
        """A checkpoint was just written: the clock starts again."""
        self.last_save = time.monotonic()

    def check(self, step: int) -> tuple[bool, bool]:
        """(stop after this step, a checkpoint is due by `every_minutes`): decided together by all
        hosts, so each saves and stops at the same step."""
        due = bool(self.every_s) and time.monotonic() - self.last_save >= self.every_s
        stop, due = any_hosts(self.received is not None, due)
        if self._jax_service and multihost_utils.reached_preemption_sync_point(step):
            stop = True
            self.received = self.received or "a preemption notice (JAX preemption service)"
        return stop, due
