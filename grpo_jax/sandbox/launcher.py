"""Starting, supervising and tearing down one sandboxed run (the measures: see `grpo_jax.sandbox`).

The launcher is found once per interpreter by probing the strongest isolation first. Each run gets
a fresh temporary directory (chowned to the sandbox user) holding a copy of `harness.py`, which
runs by path as `python -I <workdir>/.sandbox_harness.py CONFIG_FD STATUS_FD CONTROL_FD`; the
config (code, tests, calls, nonce, limits) arrives on CONFIG_FD, an unlinked file no other sample
can open. With a mount namespace the harness then moves into a private tmpfs (`harness.private_tmp`). The copy, not the package's
own file, because as root the harness runs as `nobody`, who may not be able to read the checkout
or site-packages (a checkout under /root, mode 700); the harness deletes both files before any
candidate code runs.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Literal

log = logging.getLogger(__name__)

SandboxStatus = Literal["ok", "error", "timeout", "killed", "infra_error"]

_SANDBOX_UID = 65534  # nobody: used only when this process is root
_UNSHARE_ARGS = ("--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--")
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_HARNESS_NAME = ".sandbox_harness.py"  # the per-run copy of harness.py in the sandbox's cwd
_HARNESS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
_DRAIN_S = 0.2  # after the program exits, how long stragglers may keep its pipes open
_STOP_GRACE_S = 2.0  # how long the harness has to stop the program before the process group is killed
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
    tests_passed: int | None = None  # assert-style tests only, from the harness's sentinel
    tests_total: int | None = None
    # With `calls`: per call, ("ok", its value as plain Python data) or ("error", the exception's name).
    call_values: tuple | None = None
    isolation: tuple[str, ...] = ()
    pid: int | None = None  # of the sandbox's session leader; its process group is gone on return


@dataclasses.dataclass(frozen=True)
class _Launcher:
    prefix: tuple[str, ...]  # the unshare command, or () without namespaces
    python: str
    uid: int | None
    isolation: tuple[str, ...]


class _SandboxUnavailable(RuntimeError):
    pass


_launchers: dict[str | None, _Launcher] = {}
_launchers_lock = threading.Lock()


def _user_kwargs(uid: int | None) -> dict:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _probe(argv: list[str], uid: int | None) -> str | None:
    """None if `argv` runs and exits 0 as the sandbox user, else why not."""
    try:
        r = subprocess.run(argv, capture_output=True, timeout=30, cwd="/", env={"PATH": _SAFE_PATH}, **_user_kwargs(uid))
    except (OSError, subprocess.SubprocessError) as e:
        return f"{argv[0]}: {type(e).__name__}: {e}"
    if r.returncode != 0:
        return f"{' '.join(argv[:2])}...: exit {r.returncode}: {r.stderr.decode(errors='replace').strip()[-300:]}"
    return None


def _find_unshare() -> str | None:
    return shutil.which("unshare", path=_SAFE_PATH)


def _launcher(python: str | None) -> _Launcher:
    """How to start a sandbox here, found once per interpreter choice by trying the strongest
    isolation first: namespaces before none, then `python` (default this interpreter) before the
    system python3 (root's interpreter may live where `nobody` cannot read it)."""
    with _launchers_lock:
        if python in _launchers:
            return _launchers[python]
        uid = _SANDBOX_UID if os.geteuid() == 0 else None
        pythons = [python] if python else [sys.executable]
        system_python = shutil.which("python3", path=_SAFE_PATH)
        if python is None and uid is not None and system_python and system_python not in pythons:
            pythons.append(system_python)
        unshare = _find_unshare()
        prefixes = ([(unshare, *_UNSHARE_ARGS)] if unshare else []) + [()]
        errors = []
        for prefix in prefixes:
            for py in pythons:
                error = _probe([*prefix, py, "-I", "-c", "import resource, socket"], uid)
                if error:
                    errors.append(error)
                    continue
                isolation = ("session", "rlimits", "socket-guard")
                if prefix:
                    isolation += ("userns", "netns", "mountns", "pidns")
                if uid is not None:
                    isolation += (f"uid={uid}",)
                if prefix or uid is not None:
                    isolation += ("nproc",)
                launcher = _Launcher(prefix=tuple(prefix), python=py, uid=uid, isolation=isolation)
                if errors:
                    log.warning("code sandbox: using %s with isolation %s; the options tried first failed: %s",
                                py, ", ".join(isolation), "; ".join(errors))
                _launchers[python] = launcher
                return launcher
        raise _SandboxUnavailable("no way to start a sandbox here: " + "; ".join(errors))


def sandbox_isolation(python: str | None = None) -> tuple[str, ...]:
    """The isolation measures `run_sandboxed` applies on this machine (log it at startup), e.g.
    ('session', 'rlimits', 'socket-guard', 'userns', 'netns', 'mountns', 'pidns', 'uid=65534', 'nproc').
    Raises RuntimeError when no sandbox can be started at all."""
    return _launcher(python).isolation


@functools.lru_cache(maxsize=1)
def _harness_source() -> bytes:
    """harness.py, read once (an OSError is not cached: the next run tries again)."""
    with open(_HARNESS_SOURCE, "rb") as f:
        return f.read()


def _exited(pid: int) -> bool:
    """Whether `pid` has exited, without reaping it: while it is a zombie its PID, and so its
    process group ID, cannot be reused, so killing the group afterwards cannot hit a stranger."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


def _remove_tree(path: str) -> None:
    def make_writable(func, p, _):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=make_writable)
    if os.path.exists(path):
        log.warning("code sandbox: could not remove %s", path)


def _write_private(path: str, data: bytes, uid: int | None) -> None:
    """Create `path` (it must not exist) readable only by the sandbox user."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)
    if uid is not None:
        os.chown(path, uid, uid)


def _infra(start: float, detail: str, isolation: tuple[str, ...] = (), pid: int | None = None,
           stderr: str = "") -> SandboxResult:
    return SandboxResult(status="infra_error", returncode=None, stdout="", stderr=stderr,
                         wall_s=time.monotonic() - start, detail=detail, isolation=isolation, pid=pid)


def _check_limits(timeout_s: float, cpu_s: float | None, memory_mb: int, max_output_bytes: int, max_file_mb: int,
                  max_procs: int, max_tmp_mb: int = 64) -> None:
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes),
                        ("max_file_mb", max_file_mb), ("max_procs", max_procs), ("max_tmp_mb", max_tmp_mb)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if max_procs < 2:
        raise ValueError(f"max_procs must be >= 2 (the sandbox's supervisor and the program), got {max_procs}")
    if cpu_s is not None and not cpu_s > 0:
        raise ValueError(f"cpu_s must be positive, got {cpu_s}")


def run_sandboxed(code: str, *, stdin: str = "", tests: str | None = None, calls: Sequence[str] | None = None,
                  timeout_s: float = 10.0,
                  cpu_s: float | None = None, memory_mb: int = 1024, max_output_bytes: int = 1_000_000,
                  max_file_mb: int = 16, max_procs: int = 32, max_tmp_mb: int = 64,
                  python: str | None = None) -> SandboxResult:
    """Run the Python program `code` in a sandbox (see `grpo_jax.sandbox`) and report what happened.

    Without `tests`, `code` runs as `__main__` with `stdin` on its standard input. With `tests`
    (Python source), `code` runs as module `solution` and then the tests, each top-level statement
    on its own; `tests_passed`/`tests_total` count the top-level `assert` and expression statements
    (e.g. `check(candidate)`) that ran without raising, read from the harness's nonce sentinel.

    `calls` (Python expressions, e.g. `add(2, 3)`; implies `tests`, "" if not given) are evaluated
    after the tests, in their namespace; `call_values` returns their values as plain data
    (`decode_value`), for the caller to compare with the expected values outside the sandbox.
    Only values of exact plain types come back (int, float, str, bytes, None and lists, tuples,
    sets, dicts of them); anything else is ("error", "TypeError").

    With a mount namespace the program's /tmp, /dev/shm and /var/tmp are its own tmpfs of
    `max_tmp_mb` in total (its cwd and HOME inside it), gone when it ends.

    `timeout_s` is wall-clock time for the whole process tree; `cpu_s` (default `timeout_s` + 1)
    is CPU time per process; `memory_mb` is address space per process; `max_file_mb` caps a
    written file; `max_procs` caps processes; `max_output_bytes` caps stdout and stderr each.
    """
    _check_limits(timeout_s, cpu_s, memory_mb, max_output_bytes, max_file_mb, max_procs, max_tmp_mb)
    if calls is not None and tests is None:
        tests = ""
    start = time.monotonic()
    try:
        launcher = _launcher(python)
    except _SandboxUnavailable as e:
        return _infra(start, str(e))
    cpu = math.ceil(cpu_s if cpu_s is not None else timeout_s + 1)
    limits = [("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
              ("RLIMIT_AS", memory_mb << 20, memory_mb << 20),
              ("RLIMIT_FSIZE", max_file_mb << 20, max_file_mb << 20),
              ("RLIMIT_CORE", 0, 0)]
    if "nproc" in launcher.isolation:  # else it would count every process of this user, not the sandbox's
        limits.append(("RLIMIT_NPROC", max_procs, max_procs))
    nonce = secrets.token_hex(16)
    config = {"code": code, "tests": tests, "calls": list(calls or ()), "nonce": nonce, "limits": limits,
              "unlink": [_HARNESS_NAME],
              "private_tmp_mb": max_tmp_mb if "mountns" in launcher.isolation else 0}
    try:
        proc, workdir, status_r, control_w = _spawn(launcher, config, stdin)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return _infra(start, f"could not start the sandbox: {type(e).__name__}: {e}", launcher.isolation)
    control = [control_w]
    try:
        return _supervise(proc, status_r, control, start, timeout_s, max_output_bytes, nonce, tests is not None,
                          launcher)
    finally:
        for fd in control:
            os.close(fd)
        _kill_group(proc.pid)  # a backstop: normally the group is already gone
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("code sandbox: process %d survived SIGKILL for 10 s", proc.pid)
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        os.close(status_r)
        _remove_tree(workdir)


def _spawn(launcher: _Launcher, config: dict, stdin: str) -> tuple[subprocess.Popen, str, int, int]:
    """Start the harness in a fresh temporary directory: (process, workdir, status read end,
    control write end). On failure everything made so far is undone and the error raised."""
    workdir = stdin_file = config_file = None
    status_r = status_w = control_r = control_w = -1
    try:
        workdir = tempfile.mkdtemp(prefix="grpo_sandbox_")
        if launcher.uid is not None:
            os.chown(workdir, launcher.uid, launcher.uid)
        config_file = tempfile.TemporaryFile()  # noqa: SIM115 - unlinked: reachable only through the fd
        config_file.write(json.dumps(config).encode())
        config_file.flush()
        harness = os.path.join(workdir, _HARNESS_NAME)
        _write_private(harness, _harness_source(), launcher.uid)
        # A file, not a pipe: no deadlock against a program that never reads. Closed below on both paths.
        stdin_file = tempfile.TemporaryFile()  # noqa: SIM115
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        status_r, status_w = os.pipe()
        control_r, control_w = os.pipe()  # closing control_w stops the sandbox
        env = {"PATH": _SAFE_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        proc = subprocess.Popen(
            [*launcher.prefix, launcher.python, "-I", harness, str(config_file.fileno()), str(status_w),
             str(control_r)],
            stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
            start_new_session=True, pass_fds=(config_file.fileno(), status_w, control_r), **_user_kwargs(launcher.uid))
    except BaseException:
        for fd in (status_r, status_w, control_r, control_w):
            if fd >= 0:
                os.close(fd)
        for f in (stdin_file, config_file):
            if f is not None:
                f.close()
        if workdir is not None:
            _remove_tree(workdir)
        raise
    os.close(status_w)
    os.close(control_r)
    stdin_file.close()
    config_file.close()
    return proc, workdir, status_r, control_w


def _stop(proc: subprocess.Popen, control: list[int]) -> None:
    """Ask the harness to kill the program and exit (it tears down the PID namespace, which leaves
    no orphans for the host's init to reap later); kill the process group if it does not."""
    while control:
        os.close(control.pop())
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)


def _supervise(proc: subprocess.Popen, status_r: int, control: list[int], start: float, timeout_s: float,
               max_output_bytes: int, nonce: str, with_tests: bool, launcher: _Launcher) -> SandboxResult:
    """Read the sandbox's output with caps until it ends or runs out of time, then classify."""
    outputs = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
    truncated: set[str] = set()
    deadline = start + timeout_s
    timed_out = False
    exited_at = None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
        selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
        selector.register(status_r, selectors.EVENT_READ, "status")
        while selector.get_map() and not truncated:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and _exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > _DRAIN_S:
                break  # whatever still holds the pipes open outlived the program; it is killed below
            for key, _ in selector.select(timeout=min(0.05, deadline - now)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = outputs[key.data]
                room = max_output_bytes - len(buffer)
                buffer += chunk[:room]
                if len(chunk) > room:
                    truncated.add(key.data)
    while not timed_out and not truncated and not _exited(proc.pid):
        if time.monotonic() >= deadline:
            timed_out = True
            break
        time.sleep(0.01)
    if timed_out or truncated:
        _stop(proc, control)
    else:
        _kill_group(proc.pid)  # stragglers of a finished program (without a PID namespace)
    wall_s = time.monotonic() - start
    return _classify(outputs, truncated, timed_out, wall_s, start, timeout_s, max_output_bytes, nonce, with_tests,
                     launcher, proc.pid)


def decode_value(encoded):
    """The plain Python value of `harness.encode_value`'s output (built here from literals only)."""
    tag, payload = encoded
    if tag == "v":
        if type(payload) not in (bool, int, str, bytes, type(None)):
            raise ValueError(f"not a scalar: {payload!r}")
        return payload
    if tag == "f":
        return float(payload)
    if tag in ("l", "t", "s", "fs"):
        items = [decode_value(v) for v in payload]
        return {"l": list, "t": tuple, "s": set, "fs": frozenset}[tag](items)
    if tag == "d":
        return {decode_value(k): decode_value(v) for k, v in payload}
    raise ValueError(f"unknown tag {tag!r}")


def _decode_calls(text: bytes) -> tuple | None:
    """The calls' results from the sentinel line; None when it does not read back (then nothing
    of it can be trusted)."""
    try:
        raw = ast.literal_eval(text.decode())
        return tuple(("ok", decode_value(v)) if kind == "ok" else ("error", str(v)) for kind, v in raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, UnicodeDecodeError):
        return None


def _classify(outputs: dict[str, bytearray], truncated: set[str], timed_out: bool, wall_s: float, start: float,
              timeout_s: float, max_output_bytes: int, nonce: str, with_tests: bool, launcher: _Launcher,
              pid: int) -> SandboxResult:
    """The result of a finished (or stopped) run, from what it wrote on its three pipes."""
    stdout, stderr = bytes(outputs["stdout"]), bytes(outputs["stderr"])
    passed = total = values = None
    if with_tests:
        # The last one: the harness writes it after everything the candidate ran, then exits.
        found = list(re.finditer(rb"\n" + re.escape(nonce.encode()) + rb" (\d+) (\d+) ([^\n]*)\n", stdout))
        if found:
            sentinel = found[-1]
            passed, total = int(sentinel.group(1)), int(sentinel.group(2))
            values = _decode_calls(sentinel.group(3))
            stdout = stdout[:sentinel.start()] + stdout[sentinel.end():]
    status_text = bytes(outputs["status"])
    reported = _STATUS_LINE.findall(status_text)
    returncode = int(reported[-1]) if reported else None  # the harness writes last, then exits
    stderr_text = stderr.decode(errors="replace")
    fields = dict(stdout=stdout.decode(errors="replace"), stderr=stderr_text, wall_s=wall_s, isolation=launcher.isolation,
                  pid=pid, stdout_truncated="stdout" in truncated, stderr_truncated="stderr" in truncated,
                  tests_passed=passed, tests_total=total, call_values=values)
    if not status_text.startswith(b"S\n"):
        return _infra(start, f"the sandbox did not start: {stderr_text.strip()[-500:]}", launcher.isolation, pid,
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
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        return SandboxResult(status="killed", returncode=returncode, detail=f"killed by {name}", **fields)
    return SandboxResult(status="error", returncode=returncode, detail=f"exit status {returncode}", **fields)
