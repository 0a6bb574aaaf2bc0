"""Starting, supervising and tearing down one sandboxed run (the measures: see `grpo_jax.sandbox`;
how a sandbox starts here: `launcher`; what the run came to: `result`).

Each run gets a fresh temporary directory (chowned to the sandbox user) holding a copy of
`harness.py`, which runs by path as `python -I <workdir>/.sandbox_harness.py CONFIG_FD STATUS_FD
CONTROL_FD`, and with tests a copy of `grader.py`, which the harness loads by path; the config
(code, limits) arrives on CONFIG_FD and the tests, calls and nonce on the config's `tests_fd`, two
unlinked files no other sample can open; the harness hands the second to the grader only. With a
mount namespace the harness then moves into a private tmpfs (`harness.private_tmp`). Copies, not
the package's own files, because as root the harness runs as `nobody`, who may not be able to read
the checkout or site-packages (a checkout under /root, mode 700); the harness deletes the copies
before any candidate code runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence

from grpo_jax.sandbox.launcher import SAFE_PATH, Launcher, SandboxUnavailable, find_launcher, user_kwargs
from grpo_jax.sandbox.result import SandboxResult, classify, infra_error
from grpo_jax.sandbox.seccomp import memory_filter

MAX_OPEN_FILES = 256  # per sandboxed process (RLIMIT_NOFILE)

log = logging.getLogger(__name__)

_HARNESS_NAME = ".sandbox_harness.py"  # the per-run copy of harness.py in the sandbox's cwd
_GRADER_NAME = ".sandbox_grader.py"  # and of grader.py, with tests
_HERE = os.path.dirname(os.path.abspath(__file__))
_DRAIN_S = 0.2  # after the program exits, how long stragglers may keep its pipes open
_STOP_GRACE_S = 2.0  # how long the harness has to stop the program before the process group is killed


@functools.lru_cache(maxsize=2)
def _source(name: str) -> bytes:
    """harness.py or grader.py, read once (an OSError is not cached: the next run tries again)."""
    with open(os.path.join(_HERE, name), "rb") as f:
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
    (Python source), `code` runs as module `solution` and the tests run in the grader's process
    (`grader.py`), each top-level statement on its own, calling the candidate's functions over a
    pipe; `tests_passed`/`tests_total` count the top-level `assert` and expression statements
    (e.g. `check(candidate)`) that ran without raising, from the grader's report.

    `calls` (Python expressions, e.g. `add(2, 3)`; implies `tests`, "" if not given) are evaluated
    by the grader after the tests, in their namespace; `call_values` returns their values as plain
    data (`grader.decode`), for the caller to compare with the expected values outside the sandbox.
    Only values of exact plain types come back (int, float, str, bytes, None and lists, tuples,
    sets, dicts of them); anything else is ("error", "TypeError").

    With a mount namespace the program's /tmp, /dev/shm and /var/tmp are its own tmpfs of
    `max_tmp_mb` in total (its cwd and HOME inside it), gone when it ends.

    `timeout_s` is wall-clock time for the whole process tree; `cpu_s` (default `timeout_s` + 1)
    is CPU time per process; `memory_mb` is address space per process (memfds and SysV shared
    memory, which it would not count, are refused: `grpo_jax.sandbox.seccomp`); `max_file_mb` caps a
    written file; `max_procs` caps processes; `max_output_bytes` caps stdout and stderr each.
    """
    _check_limits(timeout_s, cpu_s, memory_mb, max_output_bytes, max_file_mb, max_procs, max_tmp_mb)
    if calls is not None and tests is None:
        tests = ""
    if tests is not None and max_procs < 3:
        raise ValueError(f"max_procs must be >= 3 with tests (supervisor, grader and program), got {max_procs}")
    graded = None if tests is None else {"tests": tests, "calls": list(calls or ()), "nonce": secrets.token_hex(16)}
    start = time.monotonic()
    try:
        launcher = find_launcher(python)
    except SandboxUnavailable as e:
        return infra_error(start, str(e))
    config = _harness_config(launcher, code, graded is not None, timeout_s=timeout_s, cpu_s=cpu_s,
                             memory_mb=memory_mb, max_file_mb=max_file_mb, max_procs=max_procs, max_tmp_mb=max_tmp_mb)
    try:
        proc, workdir, status_r, control_w = _spawn(launcher, config, graded, stdin)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return infra_error(start, f"could not start the sandbox: {type(e).__name__}: {e}", launcher.isolation)
    control = [control_w]
    try:
        return _supervise(proc, status_r, control, start, timeout_s, max_output_bytes,
                          graded["nonce"] if graded else None, launcher)
    finally:
        _tear_down(proc, control, status_r, workdir)


def _harness_config(launcher: Launcher, code: str, graded: bool, *, timeout_s: float, cpu_s: float | None,
                    memory_mb: int, max_file_mb: int, max_procs: int, max_tmp_mb: int) -> dict:
    """What the harness reads on its config descriptor: the program, the grader's copy (with tests;
    `_spawn` adds the descriptor of the tests), and the rlimits it sets before any candidate code runs."""
    cpu = math.ceil(cpu_s if cpu_s is not None else timeout_s + 1)
    limits = [("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
              ("RLIMIT_AS", memory_mb << 20, memory_mb << 20),
              ("RLIMIT_FSIZE", max_file_mb << 20, max_file_mb << 20),
              ("RLIMIT_CORE", 0, 0),
              # Socket and pipe buffers count against neither RLIMIT_AS nor the tmpfs: bound how many a
              # process can hold (1,500 socketpairs held 333 MB of queued data with the inherited limit).
              ("RLIMIT_NOFILE", MAX_OPEN_FILES, MAX_OPEN_FILES)]
    if "nproc" in launcher.isolation:  # else it would count every process of this user, not the sandbox's
        limits.append(("RLIMIT_NPROC", max_procs, max_procs))
    return {"code": code, "limits": limits, "unlink": [_HARNESS_NAME, _GRADER_NAME] if graded else [_HARNESS_NAME],
            "grader": _GRADER_NAME if graded else None,
            "private_tmp_mb": max_tmp_mb if "mountns" in launcher.isolation else 0,
            "seccomp": memory_filter() if "seccomp" in launcher.isolation else None}


def _tear_down(proc: subprocess.Popen, control: list[int], status_r: int, workdir: str) -> None:
    """Close the run's pipes, kill what is left of its process group, and delete its directory."""
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


def _unlinked_file(data: dict):
    """A temporary file holding `data` as JSON, without a name: reachable only through its descriptor."""
    f = tempfile.TemporaryFile()  # noqa: SIM115 - closed by _spawn on both paths
    f.write(json.dumps(data).encode())
    f.flush()
    return f


def _spawn(launcher: Launcher, config: dict, graded: dict | None,
           stdin: str) -> tuple[subprocess.Popen, str, int, int]:
    """Start the harness in a fresh temporary directory: (process, workdir, status read end,
    control write end). On failure everything made so far is undone and the error raised."""
    workdir = stdin_file = config_file = tests_file = None
    status_r = status_w = control_r = control_w = -1
    try:
        workdir = tempfile.mkdtemp(prefix="grpo_sandbox_")
        if launcher.uid is not None:
            os.chown(workdir, launcher.uid, launcher.uid)
        passed = []
        if graded is not None:
            tests_file = _unlinked_file(graded)
            passed.append(tests_file.fileno())
            _write_private(os.path.join(workdir, _GRADER_NAME), _source("grader.py"), launcher.uid)
        config_file = _unlinked_file({**config, "tests_fd": tests_file.fileno() if tests_file else None})
        harness = os.path.join(workdir, _HARNESS_NAME)
        _write_private(harness, _source("harness.py"), launcher.uid)
        # A file, not a pipe: no deadlock against a program that never reads. Closed below on both paths.
        stdin_file = tempfile.TemporaryFile()  # noqa: SIM115
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        status_r, status_w = os.pipe()
        control_r, control_w = os.pipe()  # closing control_w stops the sandbox
        env = {"PATH": SAFE_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        proc = subprocess.Popen(
            [*launcher.prefix, launcher.python, "-I", harness, str(config_file.fileno()), str(status_w),
             str(control_r)],
            stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
            start_new_session=True, pass_fds=(config_file.fileno(), status_w, control_r, *passed),
            **user_kwargs(launcher.uid))
    except BaseException:
        for fd in (status_r, status_w, control_r, control_w):
            if fd >= 0:
                os.close(fd)
        for f in (stdin_file, config_file, tests_file):
            if f is not None:
                f.close()
        if workdir is not None:
            _remove_tree(workdir)
        raise
    os.close(status_w)
    os.close(control_r)
    for f in (stdin_file, config_file, tests_file):
        if f is not None:
            f.close()
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
               max_output_bytes: int, nonce: str | None, launcher: Launcher) -> SandboxResult:
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
    return classify(outputs, truncated, timed_out, wall_s, start, timeout_s, max_output_bytes, nonce,
                    launcher.isolation, proc.pid)
