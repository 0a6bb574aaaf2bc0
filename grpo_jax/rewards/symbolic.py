"""Symbolic answer checks through the math-verify package, under limits a completion cannot lift.

math-verify hands the answer to SymPy, where a short answer can cost minutes: `9^{9^{9^{9}}}`,
`9^{999999999}`, `(10^{100})!`. Its own timeouts are whole seconds per call (and a call is made per
extraction and per comparison), so a sample could still take several seconds. Here:

- an answer longer than `MAX_ANSWER_CHARS` characters, with brackets nested deeper than
  `MAX_BRACKET_DEPTH`, or with powers nested deeper than `MAX_POWER_DEPTH` (`a^{b^{c}}` is 2,
  `9^{9^{9^{9}}}` is 3) is not parsed at all: it scores 0;
- parsing and comparing one answer run under one wall-clock limit (`SymbolicJudge(timeout_s)`,
  math_accuracy's `verify_timeout_s`, default 0.5 s; the gold answer, parsed once, gets its own),
  enforced by a SIGALRM timer whose exception math-verify and SymPy cannot swallow (a
  BaseException, re-raised every 50 ms until it lands); an answer that runs out of time scores 0,
  a gold answer that runs out of time makes the sample unjudgeable (None).

The timer needs the main thread (Python delivers signals there only): elsewhere a judge raises
RuntimeError rather than run SymPy without a limit.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator

MAX_ANSWER_CHARS = 200
MAX_BRACKET_DEPTH = 5
MAX_POWER_DEPTH = 2
DEFAULT_TIMEOUT_S = 0.5
_REPEAT_S = 0.05  # the timer fires again until its exception gets through
_warmed = False


class OutOfTime(BaseException):
    """Raised by `time_limit` when the time is up (not an Exception: library code that catches
    every Exception must not turn it into an ordinary failure and carry on)."""


def load_math_verify():
    """The math_verify module (imported on every call, so a missing package is always reported),
    warmed once outside any time limit: its first calls import SymPy modules, which a time limit
    must not interrupt."""
    global _warmed
    try:
        import math_verify
    except ImportError:
        raise ImportError("math_accuracy(verifier='math_verify') needs the math-verify package: "
                          "pip install math-verify (or use verifier='numeric' / 'auto')") from None
    if not _warmed:
        for name in ("math_verify.parser", "math_verify.grader"):  # "timeout disabled": the limit is ours
            logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))
        for gold, answer in (("1", "x^2+1"), ("\\{1, 2\\}", "(1, 2)"), ("\\frac{1}{2}", "0.5")):
            math_verify.verify(math_verify.parse(f"${gold}$", parsing_timeout=None),
                               math_verify.parse(f"${answer}$", parsing_timeout=None), timeout_seconds=None)
        _warmed = True
    return math_verify


def too_complex(expression: str) -> str | None:
    """Why `expression` is not handed to SymPy (its length, its bracket or power nesting), or None."""
    if len(expression) > MAX_ANSWER_CHARS:
        return f"longer than {MAX_ANSWER_CHARS} characters"
    groups: list[bool] = []  # one per open bracket: is it an exponent (opened right after a ^)?
    powers = 0  # exponent groups open
    after_caret = False
    for ch in expression:
        if ch in "{([":
            groups.append(after_caret)
            powers += after_caret
            if len(groups) > MAX_BRACKET_DEPTH:
                return f"brackets nested deeper than {MAX_BRACKET_DEPTH}"
        elif ch in "})]" and groups:
            powers -= groups.pop()
        elif ch == "^" and powers + 1 > MAX_POWER_DEPTH:
            return f"powers nested deeper than {MAX_POWER_DEPTH}"
        after_caret = ch == "^" or (after_caret and ch.isspace())
    return None


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise OutOfTime in the block after `seconds` of wall-clock time (main thread only). A timer
    set before is put back afterwards, less the time the block took."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("math_accuracy(verifier='math_verify') must run in the main thread: its time limits "
                           "use SIGALRM, and SymPy without a time limit can run for minutes on a short answer")
    state = {"on": True}

    def on_alarm(signum, frame):
        if state["on"]:
            raise OutOfTime(f"no result within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    if previous is None:  # a handler not set from Python: the default is the closest to put back
        previous = signal.SIG_DFL
    started = time.monotonic()
    before = signal.setitimer(signal.ITIMER_REAL, seconds, _REPEAT_S)
    try:
        yield
    finally:
        while True:  # the timer may fire while this cleans up: retry until it is off
            try:
                state["on"] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                break
            except OutOfTime:
                continue
        if before[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, max(before[0] - (time.monotonic() - started), 1e-3), before[1])


class SymbolicJudge:
    """Scores answers against gold answers with math-verify, each under `time_limit(timeout_s)`;
    the gold answers are parsed once per judge (one judge per reward call)."""

    def __init__(self, math_verify, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"verify_timeout_s must be > 0, got {timeout_s}")
        self.mv, self.timeout_s, self.golds = math_verify, timeout_s, {}

    def gold(self, gold_text: str):
        """The parsed gold answer, or None when math-verify cannot read it (in time)."""
        if gold_text not in self.golds:
            try:
                with time_limit(self.timeout_s):
                    self.golds[gold_text] = self.mv.parse(f"${gold_text}$", parsing_timeout=None) or None
            except OutOfTime:
                self.golds[gold_text] = None
        return self.golds[gold_text]

    def __call__(self, predicted: str | None, gold_text: str) -> float | None:
        """1.0 / 0.0, or None when the gold answer cannot be read."""
        gold = self.gold(gold_text)
        if gold is None:
            return None
        if predicted is None or too_complex(predicted):
            return 0.0
        try:
            with time_limit(self.timeout_s):
                answer = self.mv.parse(f"${predicted}$", parsing_timeout=None)
                return 1.0 if self.mv.verify(gold, answer, timeout_seconds=None) else 0.0
        except OutOfTime:
            return 0.0
