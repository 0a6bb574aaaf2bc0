"""The trusted harness that runs inside the sandbox: limits, then the candidate in a forked child.

Run as `python -I harness.py CONFIG_FD STATUS_FD CONTROL_FD` with the sandbox's temporary directory as
cwd (`runner.run_sandboxed` copies this file there, so the sandbox user can read it wherever the
checkout lives; see `runner._HARNESS_NAME`). The harness process (PID 1 of the sandbox's PID
namespace, where there is one) reads CONFIG_FD (an unlinked file), deletes the files the config names
(that copy), mounts its private /tmp, /dev/shm and /var/tmp and drops every capability (with a
mount namespace), sets the limits, then
forks the child that runs the candidate, and reports the child's exit status on STATUS_FD, which
the child closes first: the candidate can neither fake its status nor inherit PID 1's signal
handling (which ignores SIGXCPU). To stop the sandbox, the supervisor closes CONTROL_FD; the
harness then kills the child and exits, and the kernel kills and reaps everything else in the
namespace before `unshare` reaps the harness, so the whole tree is gone by the time the supervisor
reaps `unshare`.

Standard library only: it runs under `python -I` without grpo_jax on sys.path. Importing it runs
nothing, so its helpers are unit-tested in-process.
"""

from __future__ import annotations  # the fallback interpreter may be older than this package's

import ast
import builtins
import ctypes
import json
import os
import resource
import select
import signal
import socket
import sys
import traceback
import types

_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_MS_NOSUID, _MS_NODEV, _MS_BIND = 2, 4, 4096
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
PRIVATE_DIRS = ("/tmp", "/dev/shm", "/var/tmp")  # each sample's own, in its mount namespace
WORKDIR = "/tmp/work"  # the candidate's cwd inside its private /tmp


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def private_tmp(size_mb: int) -> str:
    """One tmpfs of `size_mb` (their total cap) mounted on /tmp, with directories of it bound over
    /dev/shm and /var/tmp, in this process's own mount namespace: the sample sees none of the
    host's or another sample's temporary files, and everything it writes there dies with the
    namespace. Returns the new working directory."""
    libc = _libc()

    def mount(source, target, fstype, flags, data):
        if libc.mount(source, target, fstype, flags, data) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mount {target.decode()}: {os.strerror(errno)}")

    mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=%dm,mode=1777" % size_mb)
    for target in PRIVATE_DIRS[1:]:
        if os.path.isdir(target):
            inner = "/tmp/.private" + target.replace("/", "_")
            os.mkdir(inner, 0o1777)
            mount(inner.encode(), target.encode(), None, _MS_BIND, None)
    os.mkdir(WORKDIR, 0o700)
    os.chdir(WORKDIR)
    return WORKDIR


def drop_capabilities() -> None:
    """No capability left (in the sandbox's user namespace, where it is root), none to regain: the
    candidate cannot unmount its private /tmp to reach the host's, nor mount anything."""
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap}) failed")
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def guard_network() -> None:
    """Second line behind the network namespace: plain socket users get a clear error."""

    class GuardedSocket(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and (socket.AF_INET if family == -1 else family) in (socket.AF_INET, socket.AF_INET6):
                raise OSError(101, "network access is disabled in the sandbox")
            super().__init__(family, type, proto, fileno)

    def no_network(*args, **kwargs):
        raise OSError(101, "network access is disabled in the sandbox")

    socket.socket = GuardedSocket
    socket.getaddrinfo = socket.gethostbyname = socket.gethostbyname_ex = no_network


def clean_sys_path(entries: list, script_dir: str) -> list:
    """`entries` without the harness's own directory and without '' (the cwd, which the candidate
    can write). `-I` already leaves both out; this holds even if the harness is started without it,
    so a candidate can never import a sibling of the harness or a file it wrote itself."""
    script_dir = os.path.realpath(script_dir)
    return [p for p in entries if p and os.path.realpath(p) != script_dir]


def exit_code(e: SystemExit) -> int:
    """What the interpreter would exit with for `SystemExit(e.code)`."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def flush() -> None:
    """Flush stdout and stderr, whatever the candidate did to them."""
    # Not contextlib.suppress: the fewer modules the harness uses after the candidate ran, the
    # fewer the candidate can have patched.
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105
            stream.flush()
        except BaseException:
            pass


def is_test(node: ast.stmt) -> bool:
    """A top-level assert or call-like expression counts as a test; a bare constant (a docstring)
    does not. The code reward counts the expected tests with this same function."""
    return isinstance(node, ast.Assert) or (isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant))


def parse_tests(source: str) -> list:
    """Each top-level statement of `source` compiled on its own, with 1 if it is a test, else 0."""
    return [(compile(ast.Module([node], type_ignores=[]), "tests.py", "exec"), int(is_test(node)))
            for node in ast.parse(source, "tests.py").body]


def tests_namespace(candidate: dict, pristine_builtins: dict) -> dict:
    """The globals the tests run in: the candidate's public names, minus any that shadow a builtin,
    and a copy of the builtins taken before the candidate ran (so patching `builtins` is ignored)."""
    namespace = {k: v for k, v in candidate.items() if not k.startswith("__") and k not in pristine_builtins}
    namespace.update(__name__="__tests__", __builtins__=pristine_builtins)
    return namespace


def run_statements(tests: list, namespace: dict, *, exec_=exec, report=traceback.print_exception,
                   base_exception=BaseException) -> int:
    """Run the compiled test statements in `namespace` and return how many tests passed. A failing
    test is reported and skipped; a failing setup statement (a def, an import) stops the rest,
    which could not run without it. The defaults are bound when the harness is imported, before
    any candidate code runs, so a candidate that patches `builtins.exec` cannot reach them."""
    passed = 0
    for statement, test in tests:
        try:
            exec_(statement, namespace)
        except base_exception as e:
            report(e.__class__, e, e.__traceback__.tb_next)
            if not test:
                break
            continue
        passed += test
    return passed


def run_script(code) -> None:
    """Run `code` as `__main__` and exit the process with its status."""
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


_type, _repr, _dict_items = type, repr, dict.items  # bound before any candidate code exists
_SCALARS = (bool, int, str, bytes, type(None))
_SEQUENCES = {list: "l", tuple: "t", set: "s", frozenset: "fs"}


def encode_value(value, depth: int = 0):
    """A returned value as nested tuples of builtin scalars, whose `repr` the trusted side reads
    back with `ast.literal_eval` (`result.decode_value`). Only exact plain types pass (bool, int,
    float, str, bytes, None, and list, tuple, set, frozenset, dict of them): an object that
    pretends to be one (an always-equal `__eq__`, an int subclass) is refused with a TypeError."""
    t = _type(value)
    if depth > 100:
        raise TypeError("the value is nested more than 100 levels deep")
    if t in _SCALARS:
        return ("v", value)
    if t is float:
        return ("f", _repr(value))  # nan and inf are not literals
    if t in _SEQUENCES:
        return (_SEQUENCES[t], [encode_value(v, depth + 1) for v in value])
    if t is dict:
        return ("d", [(encode_value(k, depth + 1), encode_value(v, depth + 1)) for k, v in _dict_items(value)])
    raise TypeError(f"a {t.__module__}.{t.__qualname__} is not a plain value (int, float, str, list, dict, ...)")


def run_calls(calls: list, namespace: dict, *, eval_=eval, encode=encode_value, base_exception=BaseException) -> list:
    """Evaluate each compiled call expression in `namespace` -> [("ok", encoded value) or
    ("error", exception name)]. Comparing with the expected values happens outside the sandbox."""
    results = []
    for call in calls:
        try:
            results.append(("ok", encode(eval_(call, namespace))))
        except base_exception as e:
            results.append(("error", e.__class__.__name__))
    return results


def run_tests(code, tests: list, nonce: str, calls: list = ()) -> None:
    """Run `code` as module `solution`, then the tests, then the calls whose values the trusted
    side checks; print the nonce sentinel with the pass count and the calls' values, and exit 0
    only when the last test has run."""
    # Bind everything the harness needs before the candidate can touch modules, builtins or this
    # module's globals (it can `import __main__`, which is the harness).
    write, exit_, exec_, report, base_exception = os.write, os._exit, exec, traceback.print_exception, BaseException
    run_statements_, tests_namespace_, flush_, run_calls_, repr_ = run_statements, tests_namespace, flush, run_calls, repr
    pristine_builtins = dict(builtins.__dict__)
    total = sum(test for _, test in tests)
    out_fd = os.dup(1)
    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    try:
        exec_(code, module.__dict__)
    except base_exception as e:
        report(e.__class__, e, e.__traceback__.tb_next)
        flush_()
        exit_(1)  # a candidate that exits (even with status 0) or fails before the tests fails them all
    namespace = tests_namespace_(module.__dict__, pristine_builtins)
    passed = run_statements_(tests, namespace, exec_=exec_, report=report, base_exception=base_exception)
    values = run_calls_(calls, namespace, base_exception=base_exception)
    flush_()
    write(out_fd, f"\n{nonce} {passed} {total} {repr_(values)}\n".encode())
    exit_(0)


def _set_up(config: dict) -> None:
    """Private temporary directories (with a mount namespace), no capabilities, limits,
    non-dumpable, network guard: everything before any candidate code exists."""
    if config.get("private_tmp_mb"):
        os.environ["HOME"] = os.environ["TMPDIR"] = private_tmp(config["private_tmp_mb"])
        drop_capabilities()
    for name, soft, hard in config["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    # Not dumpable (inherited by the fork): other processes of the same uid, such as concurrent
    # sandboxes, cannot ptrace this one or open its /proc/PID/fd and /proc/PID/mem.
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    guard_network()


def _child(config: dict, tests: list | None, status_fd: int, control_fd: int) -> None:
    """The forked child: compile and run the candidate; never returns."""
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
    calls = [compile(c, "tests.py", "eval") for c in config.get("calls") or ()]
    run_tests(code, tests, config["nonce"], calls)


def _wait(pid: int, status_fd: int, control_fd: int) -> None:
    """Report the child's exit status, or kill it when the supervisor closes CONTROL_FD; then exit."""
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


def read_config(fd: int) -> dict:
    """The run's config from `fd` (an unlinked file: it has no name another sample could open)."""
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


def main() -> None:
    """Entry point inside the sandbox: `harness.py CONFIG_FD STATUS_FD CONTROL_FD`."""
    sys.path[:] = clean_sys_path(sys.path, os.path.dirname(os.path.abspath(__file__)))
    config_fd, status_fd, control_fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    config = read_config(config_fd)
    # The runner's copy of this file: gone before the candidate runs, so the cwd it sees is empty.
    for path in config["unlink"]:
        os.unlink(path)
    _set_up(config)
    tests = None if config["tests"] is None else parse_tests(config["tests"])
    sys.argv = ["solution.py"]
    os.write(status_fd, b"S\n")
    pid = os.fork()
    if pid == 0:
        _child(config, tests, status_fd, control_fd)
    config = None
    _wait(pid, status_fd, control_fd)


if __name__ == "__main__":
    main()
