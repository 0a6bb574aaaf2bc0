"""Preemption: a preemption notice (SIGTERM) or Ctrl-C (SIGINT) ends the run at the next point where
nothing is lost, and the run returns normally (the command exits 0); a second signal aborts at once.

Where a first signal lands decides what the run does (`StopSignals.stage`):
- "setup", before the first step (input checks, the pieces, the warm start, the first evaluation):
  nothing new is there to save, so the run stops at the next `stop_point` (between setup phases and
  between warm-start steps) with one line saying so;
- "steps": the step in flight ends, a checkpoint is saved at it and the run stops;
- "finish", after the last step: the run finishes as it would have (its last checkpoint committed,
  its metrics, summary and plot written): there is nothing shorter that loses nothing.
The handlers stay installed through all three, until the last file is written. In "setup" and
"steps" a signal also ends every wait on user code (grpo_jax.usercode: a slow reward, a hanging
environment): those calls fail at once (their samples dropped, counted), so the step in flight ends
promptly and is saved as above.

A run whose user code fails beyond use (every episode of a step, a reward on every sample for
`train.max_reward_failure_steps` steps: rewards.watch) stops the same way, its step saved, and
then raises RunFailed with the reason and the checkpoint in one line (`fail`).

On one host the trainer's own signal handlers set the flag. On several hosts (jax.distributed)
JAX's preemption service already owns SIGTERM: it agrees on a step every host reaches
(`multihost_utils.reached_preemption_sync_point`), so every host saves the same step; SIGINT is
still ours, and a flag set on any host stops every host at the same step (one small collective
per step, and one per stop point, shared with the wall-clock checkpoint decision).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from jax.experimental import multihost_utils

from grpo_jax.faults import RunFault
from grpo_jax.runtime.hosts import any_host, any_hosts, multi_process
from grpo_jax.usercode import add_stop_source, remove_stop_source

STAGES = ("setup", "steps", "finish")
_PLANS = {"setup": "stopping before the first step, without saving",
          "steps": "finishing this step, then saving a checkpoint and stopping",
          "finish": "the last step is done: finishing its checkpoint and the run's files, then stopping"}


class RunFailed(RunFault):
    """User code failed beyond use (`StopSignals.fail`): the step was saved, the run stopped. The
    message is one line: why, and where the checkpoint is (the CLI prints it, exit status 1)."""


class StoppedBeforeStart(Exception):
    """A stop signal arrived before the run's first step (raised at a `stop_point`): nothing new
    to save. The argument is the signal's name."""


def _jax_preemption_service() -> bool:
    """True when jax.distributed runs its preemption service (it then handles SIGTERM itself).
    JAX has no public query for the service itself; `jax.distributed.initialize` starts it exactly
    when `jax_enable_preemption_service` is set (the default), a public config flag, so this reads
    the flag (the caller asks only in a multi-process run, i.e. after initialize)."""
    import jax

    return bool(jax.config.jax_enable_preemption_service)


# The StopSignals whose handlers are installed: handlers are process-wide, and so is this (read by
# `stop_point`, which code far from the trainer calls, e.g. the warm start between its steps).
_installed: list[StopSignals] = []


def stop_point() -> None:
    """A point before the run's first step where it can stop losing nothing: raises
    StoppedBeforeStart when the installed StopSignals received a signal (on any host: every host
    calls this at the same points). Does nothing without installed handlers or after the setup."""
    if _installed and _installed[-1].stage == "setup":
        _installed[-1].stop_point()


class StopSignals:
    """Context manager installing the handlers (main thread only; restored on exit), the per-step
    decision `check(step)` -> (stop, checkpoint due by the clock), the same on every host, and
    `stop_point()` before the first step. The trainer moves `stage` on as the run goes (STAGES)."""

    def __init__(self, log: Callable[[str], None], *, every_minutes: float = 0.0, stage: str = "steps"):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        self.log = log
        self.every_s = every_minutes * 60.0
        self.received: str | None = None  # the signal's name, once one arrived (on this host)
        self.failure: str | None = None  # why user code stops the run (`fail`)
        self.stage = stage
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}
        self._jax_service = multi_process() and _jax_preemption_service()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            signals = [signal.SIGINT] + ([] if self._jax_service else [signal.SIGTERM])
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        _installed.append(self)
        add_stop_source(self._stopping)
        return self

    def __exit__(self, *exc) -> None:
        _installed.remove(self)
        remove_stop_source(self._stopping)
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
        self.log(f"received {name}: {_PLANS[self.stage]} (send {name} again to abort at once)")

    def _stopping(self) -> str | None:
        """Why waits on user code end now: a signal arrived before the run's last step."""
        return f"the run received {self.received}" if self.received and self.stage != "finish" else None

    @property
    def stopping(self) -> bool:
        """A signal arrived or user code failed: the run stops after this step."""
        return self.received is not None or self.failure is not None

    def fail(self, reason: str | None) -> None:
        """User code failed beyond use (`reason`; None: nothing): save this step, then stop (RunFailed)."""
        if reason and self.failure is None:
            self.failure = reason
            self.log(f"stopping: {reason}")

    def stop_point(self) -> None:
        """Raise StoppedBeforeStart if a signal arrived on any host (a collective on several)."""
        if any_host(self.received is not None):
            raise StoppedBeforeStart(self.received or "a stop signal on another host")

    def saved(self) -> None:
        """A checkpoint was just written: the clock starts again."""
        self.last_save = time.monotonic()

    def check(self, step: int) -> tuple[bool, bool]:
        """(stop after this step, a checkpoint is due by `every_minutes`): decided together by all
        hosts, so each saves and stops at the same step."""
        due = bool(self.every_s) and time.monotonic() - self.last_save >= self.every_s
        stop, due = any_hosts(self.stopping, due)
        if self._jax_service and multihost_utils.reached_preemption_sync_point(step):
            stop = True
            self.received = self.received or "a preemption notice (JAX preemption service)"
        return stop, due


def stop_report(why: str | None, *, step: int | None, steps: int, where: str, resuming: bool,
                log: Callable[[str], None], failure: str | None = None) -> None:
    """The last line (to `log`) of a run a stop signal ended: after `step`, whose
    checkpoint is complete in `where`, or before its first step (`step` None): nothing saved yet,
    or nothing new for a `resuming` run. Without a signal (`why` None) the run stopped for
    `failure`: RunFailed, in one line."""
    again = "run the same command again to"
    if why is None and failure is not None:
        line = (f"{failure}; the run stopped after step {step} of {steps}, its checkpoint is in {where} (fix the "
                f"cause and {again} resume from it)")
        log(line)
        raise RunFailed(line)
    why = why or "a stop on another host"
    if step is not None:
        line = f"stopped by {why} after step {step} of {steps}: its checkpoint is in {where}; {again} resume from it"
    elif resuming:
        line = (f"stopped by {why} before its next step: nothing new was saved; {again} resume from its newest "
                f"checkpoint in {where}")
    else:
        line = f"stopped by {why} before the first checkpoint: nothing was saved yet; {again} start the run"
    log(line)
