"""A call of user code with a time limit, and the trainer's bounded pool of threads for the calls
that run in its own process.

A `Call` is started at once and read later: `ready(timeout_s)` (never waits) and
`result(timeout_s)` (waits for what is left of `timeout_s`, counted from the start). A call past
its time limit raises `CallTimeout`; its value, if it ever comes, is ignored. Once the run is
stopping (a SIGTERM or Ctrl-C: grpo_jax.trainer.preemption registers itself with
`add_stop_source`), every wait gives up at once with `CallStopped`: a run that was told to stop
does not wait for a slow reward or a hanging environment.

In the trainer's process (`start_local`: built-in environments, environments passed as Python
callables) the calls run on `LocalPool`'s daemon threads, at most `LOCAL_THREADS` of them: a call
that hangs keeps its thread, which is never replaced, so hanging calls cannot add threads; when
every thread is held, a new call waits in the queue and times out there. User code named in the
config runs in worker processes instead (grpo_jax.usercode.workers), where a hanging call is
ended with its process.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

LOCAL_THREADS = 64
_SLICE_S = 0.05  # a wait looks at the stop sources this often


class CallTimeout(TimeoutError):
    """A call of user code that did not return within its time limit."""


class CallStopped(RuntimeError):
    """A call the run gave up on because it is stopping (a stop signal)."""


_stop_sources: list[Callable[[], str | None]] = []


def add_stop_source(source: Callable[[], str | None]) -> None:
    """`source()` -> why the run is stopping (calls then give up at once), or None."""
    _stop_sources.append(source)


def remove_stop_source(source: Callable[[], str | None]) -> None:
    if source in _stop_sources:
        _stop_sources.remove(source)


def stopping() -> str | None:
    """Why the run is stopping, or None."""
    for source in list(_stop_sources):
        if why := source():
            return why
    return None


class Call:
    """One call in flight (see the module docstring). Subclasses deliver the outcome (`finish`)
    and may look for it when asked (`poll`, `wait_some`); `expired` and `abandoned` are told when
    the caller gives up on it."""

    def __init__(self, convert: Callable[[Any], Any] | None = None):
        self.started = time.monotonic()
        self.seconds: float | None = None  # how long it ran, once finished
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.convert = convert  # applied to the value in the caller's thread

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        self.value, self.error, self.seconds = value, error, time.monotonic() - self.started
        self.done.set()

    def poll(self) -> None:
        """Take in the outcome if it has arrived (does not wait)."""

    def wait_some(self, seconds: float) -> None:
        """Wait up to `seconds` for the outcome."""
        self.done.wait(seconds)

    def expired(self) -> None:
        """The caller gave up on it at its time limit."""

    def abandoned(self) -> None:
        """The caller gave up on it because the run is stopping."""

    def left(self, timeout_s: float) -> float:
        """Seconds left of `timeout_s` (counted from the start)."""
        return self.started + timeout_s - time.monotonic()

    def late(self, timeout_s: float) -> str:
        """What its CallTimeout says."""
        return f"took longer than {timeout_s:g} s"

    def ready(self, timeout_s: float) -> bool:
        """Returned, raised, past its time limit, or given up by a stopping run (does not wait)."""
        self.poll()
        return self.done.is_set() or self.left(timeout_s) <= 0 or stopping() is not None

    def result(self, timeout_s: float):
        """The call's value, waiting up to what is left of `timeout_s`; its exception, CallTimeout
        or CallStopped."""
        while True:
            self.poll()
            if self.done.is_set():
                if self.error is not None:
                    raise self.error
                return self.convert(self.value) if self.convert else self.value
            if (why := stopping()) is not None:
                self.abandoned()
                raise CallStopped(f"given up: {why}")
            left = self.left(timeout_s)
            if left <= 0:
                self.expired()
                raise CallTimeout(self.late(timeout_s))
            self.wait_some(min(left, _SLICE_S))


def done_call(value: Any = None, error: BaseException | None = None) -> Call:
    """A call that has already ended (a refusal, or an answer known without running anything)."""
    call = Call()
    call.finish(value, error)
    return call


class LocalPool:
    """At most `threads` daemon threads running calls in this process, started as needed; a call
    that hangs holds its thread for good (never replaced), so the count stays bounded."""

    def __init__(self, threads: int = LOCAL_THREADS):
        self.limit, self.threads, self.idle = threads, 0, 0
        self.queue: collections.deque = collections.deque()
        self.lock = threading.Condition()

    def start(self, fn: Callable, *args, convert=None) -> Call:
        call = _LocalCall(self, convert)
        with self.lock:
            self.queue.append((call, fn, args))
            if self.idle >= len(self.queue) or self.threads >= self.limit:
                self.lock.notify()
            else:
                self.threads += 1
                threading.Thread(target=self._serve, daemon=True, name="grpo-jax-user-call").start()
        return call

    def _serve(self) -> None:
        while True:
            with self.lock:
                while not self.queue:
                    self.idle += 1
                    self.lock.wait()
                    self.idle -= 1
                call, fn, args = self.queue.popleft()
                if call.done.is_set():  # given up while it waited
                    continue
                call.running = True
            try:
                value, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - what user code raises belongs to its call
                value, error = None, e
            call.finish(value, error)


class _LocalCall(Call):
    def __init__(self, pool: LocalPool, convert=None):
        super().__init__(convert)
        self.pool, self.running = pool, False

    def expired(self) -> None:  # one still in the queue never runs
        with self.pool.lock:
            if not self.running:
                self.finish(error=CallTimeout("waited for a free thread past its time limit"))

    abandoned = expired


_local = LocalPool()


def start_local(fn: Callable, *args, convert=None) -> Call:
    """`fn(*args)` on the trainer's bounded pool of threads, started now."""
    return _local.start(fn, *args, convert=convert)


def local_threads() -> int:
    """Threads the local pool has started (at most LOCAL_THREADS)."""
    return _local.threads
