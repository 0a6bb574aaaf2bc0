"""What one sandboxed run came to: `SandboxResult`, classified from what the harness wrote on its
three pipes (stdout, stderr and the status pipe), with the grader's report (on the status pipe,
which the candidate's process never has) and the calls' values decoded from it."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import time
from typing import Literal

from grpo_jax.sandbox.grader import decode

SandboxStatus = Literal["ok", "error", "timeout", "killed", "infra_error"]

_STATUS_LINE = re.compile(rb"^X (-?\d+)$", re.M)

@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What happened to one sandboxed run. `returncode` is the program's (negative: killed by that
    signal), None when it never ran or was killed by the timeout."""

    status: SandboxStatus
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    detail: str = ""  # why, for anything but "ok": the limit hit, the signal, the infrastructure error
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    tests_passed: int | None = None  # assert-style tests only, from the grader's report
    tests_total: int | None = None
    # With `calls`: per call, ("ok", its value as plain Python data) or ("error", the exception's name).
    call_values: tuple | None = None
    isolation: tuple[str, ...] = ()
    pid: int | None = None  # of the sandbox's session leader; its process group is gone on return


def infra_error(start: float, detail: str, isolation: tuple[str, ...] = (), pid: int | None = None,
                stderr: str = "") -> SandboxResult:
    """The result of a run the sandbox's infrastructure failed (`start`: its time.monotonic())."""
    return SandboxResult(status="infra_error", returncode=None, stdout="", stderr=stderr,
                         wall_s=time.monotonic() - start, detail=detail, isolation=isolation, pid=pid)


def _decode_calls(text: bytes) -> tuple | None:
    """The calls' results from the grader's report; None when it does not read back."""
    try:
        raw = json.loads(text)
        return tuple(("ok", decode(v)) if kind == "ok" else ("error", str(v)) for kind, v in raw)
    except (ValueError, TypeError, RecursionError, MemoryError):
        return None


def classify(outputs: dict[str, bytearray], truncated: set[str], timed_out: bool, wall_s: float, start: float,
             timeout_s: float, max_output_bytes: int, nonce: str | None, isolation: tuple[str, ...],
             pid: int) -> SandboxResult:
    """The result of a finished (or stopped) run, from what it wrote on its three pipes (`nonce`:
    the grader's, with tests)."""
    stdout, stderr = bytes(outputs["stdout"]), bytes(outputs["stderr"])
    status_text = bytes(outputs["status"])
    passed = total = values = None
    if nonce is not None:
        found = re.findall(rb"^R " + re.escape(nonce.encode()) + rb" (\d+) (\d+) (.*)$", status_text, re.M)
        if found:
            passed, total, values = int(found[-1][0]), int(found[-1][1]), _decode_calls(found[-1][2])
    reported = _STATUS_LINE.findall(status_text)
    returncode = int(reported[-1]) if reported else None  # the harness writes last, then exits
    stderr_text = stderr.decode(errors="replace")
    fields = dict(stdout=stdout.decode(errors="replace"), stderr=stderr_text, wall_s=wall_s, isolation=isolation,
                  pid=pid, stdout_truncated="stdout" in truncated, stderr_truncated="stderr" in truncated,
                  tests_passed=passed, tests_total=total, call_values=values)
    if not status_text.startswith(b"S\n"):
        return infra_error(start, f"the sandbox did not start: {stderr_text.strip()[-500:]}", isolation, pid,
                           stderr_text)
    if timed_out:
        return SandboxResult(status="timeout", returncode=None, detail=f"wall-clock timeout of {timeout_s:g} s", **fields)
    if truncated:
        return SandboxResult(status="killed", returncode=returncode,
                             detail=f"{' and '.join(sorted(truncated))} exceeded {max_output_bytes} bytes", **fields)
    if returncode is None:
        # The harness started the program (it wrote "S") and was killed before reporting: only the
        # program, or the limits its tree ran into, can do that. A failure, not the sandbox's.
        return SandboxResult(status="killed", returncode=None,
                             detail="the sandbox's supervisor was killed before it reported an exit status", **fields)
    if returncode == 0:
        return SandboxResult(status="ok", returncode=0, **fields)
    if returncode < 0:
        return SandboxResult(status="killed", returncode=returncode, detail=f"killed by {signal_name(-returncode)}",
                             **fields)
    return SandboxResult(status="error", returncode=returncode, detail=f"exit status {returncode}", **fields)


def signal_name(number: int) -> str:
    """A signal's name for a message: SIGKILL, a real-time one as SIGRTMIN+n (`signal.Signals` has
    members only for SIGRTMIN and SIGRTMAX, so `signal.Signals(SIGRTMIN + 3)` raises), else its number."""
    try:
        return signal.Signals(number).name
    except ValueError:
        low = getattr(signal, "SIGRTMIN", None)  # Linux; absent on macOS
        return f"SIGRTMIN+{number - low}" if low is not None and number > low else f"signal {number}"
