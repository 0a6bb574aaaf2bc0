"""Code-execution reward: run the model's program in a sandbox and grade it against tests.

The sandbox (`run_sandboxed`) is a separate process tree, never this interpreter:
- its own session and process group; at the wall-clock timeout (or an output flood) the harness
  kills the program and exits, which takes down everything in the PID namespace, and the process
  group is SIGKILLed as a backstop, so nothing of it is left when `run_sandboxed` returns;
- where unprivileged user namespaces work (`unshare`), its own user, network, mount and PID
  namespaces: no network interface but a down loopback; its own /proc, in which no process
  outside the sandbox is visible; and every process it starts dies with it, including ones that
  left the process group with `setsid`;
- when this process is root, the program runs as `nobody` (uid 65534), so it cannot write the
  checkout or read /root; with a user namespace alone, it would keep root's access to files.
  When this process is not root, the program runs as this user and can read and write what this
  user can: the filesystem is not isolated (a read-only root would need a mount setup step
  that this sandbox does not have);
- rlimits set before any model code runs: CPU seconds, address space (memory), file size,
  process count (only where it counts the sandbox's own processes: in its own user namespace or
  uid) and no core dumps; and not dumpable, so concurrent sandboxes running as the same uid
  cannot ptrace or read each other;
- `python -I` (isolated: no PYTHON* variables, no user site, no cwd on sys.path), a minimal
  environment without proxies, a fresh temporary directory as cwd that is deleted afterwards,
  and `socket` refusing internet sockets as a second line where no network namespace exists;
- stdout and stderr read with a cap: a flood is cut off and the process tree killed.
An infrastructure failure (no interpreter, no temp dir, cannot spawn, the sandbox's own
supervisor dying) is `status="infra_error"`, and the reward is None, never 0 or 1. Linux only
(namespaces, pidfd, prctl).

Grading is guarded against the usual reward hacks. Assert-style tests run in the same process as
the candidate (they call its functions), so a trusted harness runs the candidate as module
`solution`, then each top-level test statement in a separate namespace that holds the candidate's
names and a copy of the builtins taken before the candidate ran (a candidate cannot redefine the
tests' helpers, `assert`, or shadow `sorted`), and only when the last test has run it prints a
random per-run nonce with the pass count. The reward needs that sentinel and exit status 0, so
`sys.exit(0)` or `os._exit(0)` before the tests, or printing "all tests passed", scores 0. The
nonce and the tests reach the sandbox in a file the harness deletes before the candidate runs.
What this does not stop: a candidate that deliberately reads the interpreter's memory (frames,
gc, /proc/self/mem) can find the nonce, and one that returns objects whose `__eq__` is always
True passes `assert f(x) == y`. The process limits are the security boundary; the harness only
keeps the grading honest against ordinary exploits.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
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
from collections.abc import Mapping, Sequence
from typing import Literal

log = logging.getLogger(__name__)

SandboxStatus = Literal["ok", "error", "timeout", "killed", "infra_error"]

_SANDBOX_UID = 65534  # nobody: used only when this process is root
_UNSHARE_ARGS = ("--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--")
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_CONFIG_NAME = ".sandbox.json"
_DRAIN_S = 0.2  # after the program exits, how long stragglers may keep its pipes open
_STOP_GRACE_S = 2.0  # how long the harness has to stop the program before the process group is killed
_STATUS_LINE = re.compile(rb"^X (-?\d+)$", re.M)

# Runs inside the sandbox as `python -I -c _HARNESS CONFIG STATUS_FD CONTROL_FD`. The harness
# process (PID 1 of the sandbox's PID namespace) sets the limits, then forks the child that runs
# the candidate, and reports the child's exit status on STATUS_FD, which the child closes first:
# the candidate can neither fake its status nor inherit PID 1's signal handling (which ignores
# SIGXCPU). To stop the sandbox, the supervisor closes CONTROL_FD; the harness then kills the child
# and exits, and the kernel kills and reaps everything else in the namespace before `unshare`
# reaps the harness, so the whole tree is gone by the time the supervisor reaps `unshare`.
_HARNESS = r'''
import ast, builtins, ctypes, json, os, resource, select, signal, socket, sys, traceback, types

def guard_network():
    # Second line behind the network namespace: plain socket users get a clear error.
    class GuardedSocket(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and (socket.AF_INET if family == -1 else family) in (socket.AF_INET, socket.AF_INET6):
                raise OSError(101, "network access is disabled in the sandbox")
            super().__init__(family, type, proto, fileno)
    def no_network(*args, **kwargs):
        raise OSError(101, "network access is disabled in the sandbox")
    socket.socket = GuardedSocket
    socket.getaddrinfo = socket.gethostbyname = socket.gethostbyname_ex = no_network

def exit_code(e):
    # what the interpreter would exit with for SystemExit(e.code)
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1

def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass

def run_script(code):
    module = types.ModuleType("__main__")
    module.__file__ = "solution.py"
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    except SystemExit as e:
        flush()
        os._exit(exit_code(e))
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        flush()
        os._exit(1)
    sys.exit(0)  # normal interpreter shutdown: atexit handlers, non-daemon threads, flushing

def run_tests(code, tests, nonce):
    # Bind everything the harness needs before the candidate can touch modules or builtins.
    write, exit_, exec_, report, base_exception = os.write, os._exit, exec, traceback.print_exception, BaseException
    pristine_builtins = dict(builtins.__dict__)
    total = sum(is_test for _, is_test in tests)
    out_fd = os.dup(1)
    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    try:
        exec_(code, module.__dict__)
    except base_exception as e:
        report(e.__class__, e, e.__traceback__.tb_next)
        flush()
        exit_(1)  # a candidate that exits (even with status 0) or fails before the tests fails them all
    namespace = {k: v for k, v in module.__dict__.items() if not k.startswith("__") and k not in pristine_builtins}
    namespace.update(__name__="__tests__", __builtins__=pristine_builtins)
    passed = 0
    for statement, is_test in tests:
        try:
            exec_(statement, namespace)
        except base_exception as e:
            report(e.__class__, e, e.__traceback__.tb_next)
            if not is_test:
                break  # setup (a def, an import) failed: the tests after it cannot run
            continue
        passed += is_test
    flush()
    write(out_fd, ("\n%s %d %d\n" % (nonce, passed, total)).encode())
    exit_(0)

def main():
    config_path, status_fd, control_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    os.unlink(config_path)
    for name, soft, hard in config["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    # Not dumpable (inherited by the fork): other processes of the same uid, such as concurrent
    # sandboxes, cannot ptrace this one or open its /proc/PID/fd and /proc/PID/mem.
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    guard_network()
    tests = None
    if config["tests"] is not None:
        # A test is a top-level assert or call-like expression; a bare constant (a docstring) is not.
        # Same rule as _is_test in grpo_jax/rewards/code.py.
        tests = [(compile(ast.Module([node], type_ignores=[]), "tests.py", "exec"),
                  int(isinstance(node, ast.Assert) or (isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant))))
                 for node in ast.parse(config["tests"], "tests.py").body]
    sys.argv = ["solution.py"]
    os.write(status_fd, b"S\n")
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        os.close(control_fd)
        try:
            code = compile(config["code"], "solution.py", "exec")
        except SyntaxError:
            traceback.print_exc(limit=0)
            flush()
            os._exit(1)
        if tests is None:
            run_script(code)
        run_tests(code, tests, config["nonce"])
    config = None
    try:
        child_fd = os.pidfd_open(pid)  # readable when the child exits
    except (AttributeError, OSError):
        child_fd = None  # an old kernel: poll
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            os.write(status_fd, b"X %d\n" % os.waitstatus_to_exitcode(status))
            os._exit(0)  # as PID 1 of the namespace: the kernel kills and reaps everything left in it
        watched = [control_fd] if child_fd is None else [control_fd, child_fd]
        if control_fd in select.select(watched, [], [], 0.02 if child_fd is None else None)[0]:
            # The supervisor asks us to stop (timeout, output flood) or has gone away.
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)

main()
'''


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


def _exited(pid: int) -> bool:
    """Whether `pid` has exited, without reaping it: while it is a zombie its PID, and so its
    process group ID, cannot be reused, so killing the group afterwards cannot hit a stranger."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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


def _infra(start: float, detail: str, isolation: tuple[str, ...] = (), pid: int | None = None,
           stderr: str = "") -> SandboxResult:
    return SandboxResult(status="infra_error", returncode=None, stdout="", stderr=stderr,
                         wall_s=time.monotonic() - start, detail=detail, isolation=isolation, pid=pid)


def run_sandboxed(code: str, *, stdin: str = "", tests: str | None = None, timeout_s: float = 10.0,
                  cpu_s: float | None = None, memory_mb: int = 1024, max_output_bytes: int = 1_000_000,
                  max_file_mb: int = 16, max_procs: int = 32, python: str | None = None) -> SandboxResult:
    """Run the Python program `code` in a sandbox (see the module docstring) and report what happened.

    Without `tests`, `code` runs as `__main__` with `stdin` on its standard input. With `tests`
    (Python source), `code` runs as module `solution` and then the tests, each top-level statement
    on its own; `tests_passed`/`tests_total` count the top-level `assert` and expression statements
    (e.g. `check(candidate)`) that ran without raising, read from the harness's nonce sentinel.

    `timeout_s` is wall-clock time for the whole process tree; `cpu_s` (default `timeout_s` + 1)
    is CPU time per process; `memory_mb` is address space per process; `max_file_mb` caps a
    written file; `max_procs` caps processes; `max_output_bytes` caps stdout and stderr each.
    """
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes),
                        ("max_file_mb", max_file_mb), ("max_procs", max_procs)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if max_procs < 2:
        raise ValueError(f"max_procs must be >= 2 (the sandbox's supervisor and the program), got {max_procs}")
    if cpu_s is not None and not cpu_s > 0:
        raise ValueError(f"cpu_s must be positive, got {cpu_s}")
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
    workdir = stdin_file = proc = None
    status_r = status_w = control_r = control_w = -1
    try:
        workdir = tempfile.mkdtemp(prefix="grpo_sandbox_")
        config_path = os.path.join(workdir, _CONFIG_NAME)
        with open(os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            json.dump({"code": code, "tests": tests, "nonce": nonce, "limits": limits}, f)
        if launcher.uid is not None:
            os.chown(workdir, launcher.uid, launcher.uid)
            os.chown(config_path, launcher.uid, launcher.uid)
        stdin_file = tempfile.TemporaryFile()  # a file, not a pipe: no deadlock against a program that never reads
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        status_r, status_w = os.pipe()
        control_r, control_w = os.pipe()  # closing control_w stops the sandbox
        env = {"PATH": _SAFE_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        proc = subprocess.Popen(
            [*launcher.prefix, launcher.python, "-I", "-c", _HARNESS, _CONFIG_NAME, str(status_w), str(control_r)],
            stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
            start_new_session=True, pass_fds=(status_w, control_r), **_user_kwargs(launcher.uid))
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        for fd in (status_r, status_w, control_r, control_w):
            if fd >= 0:
                os.close(fd)
        if stdin_file is not None:
            stdin_file.close()
        if workdir is not None:
            _remove_tree(workdir)
        return _infra(start, f"could not start the sandbox: {type(e).__name__}: {e}", launcher.isolation)
    os.close(status_w)
    os.close(control_r)
    stdin_file.close()
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

    stdout, stderr = bytes(outputs["stdout"]), bytes(outputs["stderr"])
    passed = total = None
    if with_tests:
        sentinel = re.search(rb"\n" + re.escape(nonce.encode()) + rb" (\d+) (\d+)\n", stdout)
        if sentinel:
            passed, total = int(sentinel.group(1)), int(sentinel.group(2))
            stdout = stdout[:sentinel.start()] + stdout[sentinel.end():]
    status_text = bytes(outputs["status"])
    reported = _STATUS_LINE.findall(status_text)
    returncode = int(reported[-1]) if reported else None  # the harness writes last, then exits
    stderr_text = stderr.decode(errors="replace")
    fields = dict(stdout=stdout.decode(errors="replace"), stderr=stderr_text, wall_s=wall_s, isolation=launcher.isolation,
                  pid=proc.pid, stdout_truncated="stdout" in truncated, stderr_truncated="stderr" in truncated,
                  tests_passed=passed, tests_total=total)
    if not status_text.startswith(b"S\n"):
        return _infra(start, f"the sandbox did not start: {stderr_text.strip()[-500:]}", launcher.isolation, proc.pid,
                      stderr_text)
    if timed_out:
        return SandboxResult(status="timeout", returncode=None, detail=f"wall-clock timeout of {timeout_s:g} s", **fields)
    if truncated:
        return SandboxResult(status="killed", returncode=returncode,
                             detail=f"{' and '.join(sorted(truncated))} exceeded {max_output_bytes} bytes", **fields)
    if returncode is None:
        return _infra(start, "the sandbox's supervisor ended without reporting the program's exit status",
                      launcher.isolation, proc.pid, stderr_text)
    if returncode == 0:
        return SandboxResult(status="ok", returncode=0, **fields)
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        return SandboxResult(status="killed", returncode=returncode, detail=f"killed by {name}", **fields)
    return SandboxResult(status="error", returncode=returncode, detail=f"exit status {returncode}", **fields)


_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[ \t]*$")
_PYTHON_LANGS = ("python", "python3", "py", "")


def extract_code(completion: str) -> str | None:
    """The last complete ```python (or ```py, or untagged) fenced block, or None. A block left
    open at the end (a truncated completion) does not count."""
    blocks, current, lang = [], None, ""
    for line in completion.splitlines():
        fence = _FENCE.match(line)
        if current is None:
            if fence:
                current, lang = [], fence.group(1).lower()
        elif fence and not fence.group(1):
            if lang in _PYTHON_LANGS:
                blocks.append("\n".join(current))
            current = None
        else:
            current.append(line)
    return blocks[-1] if blocks else None


def _is_test(node: ast.stmt) -> bool:
    """A top-level assert or call-like expression counts as a test; a bare constant (a docstring)
    does not. The harness applies the same rule."""
    return isinstance(node, ast.Assert) or (isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant))


def _parse_tests(field: object) -> str | list[tuple[str, str]] | None:
    """An example's tests as assert-style source or (input, output) cases; None when malformed."""
    if isinstance(field, str):
        try:
            body = ast.parse(field).body
        except (SyntaxError, ValueError):
            return None
        return field if any(_is_test(node) for node in body) else None
    if isinstance(field, (list, tuple)) and field:
        cases = []
        for case in field:
            if not (isinstance(case, Mapping) and isinstance(case.get("input"), str) and isinstance(case.get("output"), str)):
                return None
            cases.append((case["input"], case["output"]))
        return cases
    return None


def _normalise_output(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def code_reward(prompts: Sequence[str], completions: Sequence[str], *, tests: Sequence[object],
                partial_credit: bool = False, timeout_s: float = 5.0, memory_mb: int = 1024, max_procs: int = 32,
                max_output_bytes: int = 1_000_000, max_workers: int = 2, python: str | None = None,
                **_: object) -> list[float | None]:
    """Grade the last Python code block of each completion against its example's `tests`.

    `tests` per example is either assert-style Python source that calls the candidate's functions
    (e.g. `assert add(2, 3) == 5`, or `def check(f): ...` followed by `check(add)`), or a
    non-empty list of `{"input": str, "output": str}` cases for a program that reads stdin; the
    output must match in full, after stripping trailing whitespace per line and trailing blank
    lines. 1.0 if every test passes (with `partial_credit`, the fraction that pass), 0.0 if the
    code fails or there is no code block, None if the sandbox failed (infrastructure) or the
    example's `tests` field is malformed. Samples run in parallel on `max_workers` threads.
    """
    if len(prompts) != len(completions) or len(tests) != len(completions):
        raise ValueError(f"lengths differ: {len(prompts)} prompts, {len(completions)} completions, {len(tests)} tests")
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    limits = dict(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs, max_output_bytes=max_output_bytes,
                  python=python)

    def grade(completion: str, field: object) -> float | None:
        parsed = _parse_tests(field)
        if parsed is None:
            return None
        code = extract_code(completion)
        if code is None:
            return 0.0
        if isinstance(parsed, str):
            result = run_sandboxed(code, tests=parsed, **limits)
            if result.status == "infra_error":
                return None
            expected = sum(_is_test(node) for node in ast.parse(parsed).body)
            if result.status != "ok" or result.tests_passed is None or result.tests_total != expected:
                return 0.0  # failed, exited before the sentinel, or tampered with the harness's count
            fraction = result.tests_passed / result.tests_total
            return fraction if partial_credit else float(fraction == 1.0)
        passed = 0
        for stdin, expected in parsed:
            result = run_sandboxed(code, stdin=stdin, **limits)
            if result.status == "infra_error":
                return None
            if result.status == "ok" and _normalise_output(result.stdout) == _normalise_output(expected):
                passed += 1
            elif not partial_credit:
                return 0.0
        return passed / len(parsed)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="code_reward") as pool:
        return list(pool.map(grade, completions, tests))
