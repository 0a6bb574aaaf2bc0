"""The trusted harness that runs inside the sandbox: limits, then the candidate in a forked child.

Run as `python -I harness.py CONFIG_FD STATUS_FD CONTROL_FD` with the sandbox's temporary directory as
cwd (`runner.run_sandboxed` copies this file there, so the sandbox user can read it wherever the
checkout lives; see `runner._HARNESS_NAME`). The harness process (PID 1 of the sandbox's PID
namespace, where there is one) reads CONFIG_FD (an unlinked file), deletes the files the config names
(its copies), mounts its private /tmp, /dev/shm and /var/tmp and drops every capability (with a
mount namespace), sets the limits and the seccomp filter, then forks the candidate's child, reports the
child's exit status on STATUS_FD, which the child closes first: the candidate can neither fake its
status nor inherit PID 1's signal handling (which ignores SIGXCPU). With tests, it first forks the
grader (`grader.py`, loaded from its copy), the only process that reads the tests (on the config's
`tests_fd`) and writes the report on STATUS_FD, and waits for both. To stop the sandbox, the
supervisor closes CONTROL_FD; the harness then kills its children and exits, and the kernel kills
and reaps everything else in the namespace before `unshare` reaps the harness, so the whole tree
is gone by the time the supervisor reaps `unshare`.

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
import struct
import sys
import traceback
import types

_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP = 38, 22  # the latter with SECCOMP_MODE_FILTER = 2
_MS_NOSUID, _MS_NODEV, _MS_BIND = 2, 4, 4096
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# The host's world-writable directories; each sample gets its own, in its mount namespace, where every
# other mount is read-only (/var/lock is usually a link to /run/lock: one directory, bound once).
PRIVATE_DIRS = ("/tmp", "/dev/shm", "/var/tmp", "/run/lock", "/var/lock")
_MS_RDONLY, _MS_NOEXEC, _MS_REMOUNT, _MS_STRICTATIME = 1, 8, 32, 1 << 24
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
# The flags (statvfs -> mount) a read-only remount must repeat: a locked mount may not lose them.
_KEPT_FLAGS = ((os.ST_NOSUID, 2), (os.ST_NODEV, 4), (os.ST_NOEXEC, 8), (os.ST_NOATIME, 1024),
               (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21))
WORKDIR = "/tmp/work"  # the candidate's cwd inside its private /tmp


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, source, target, fstype, flags, data) -> None:
    if libc.mount(source, target, fstype, flags, data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target.decode()}: {os.strerror(errno)}")


def mount_points() -> list:
    """This mount namespace's mount points, parents first (/proc/self/mountinfo writes a space,
    tab, newline or backslash in a path as a backslash and three octal digits)."""
    with open("/proc/self/mountinfo") as f:
        fields = [line.split()[4] for line in f]
    points = []
    for field in fields:
        head, *rest = field.split("\\")
        points.append(head + "".join(chr(int(part[:3], 8)) + part[3:] for part in rest))
    return points


def remount_read_only(libc) -> None:
    """Each mount of this mount namespace remounted read-only, one by one (before Linux 5.12), with
    the flags it has; one that refuses stays writable (the launcher's probe reports it)."""
    for point in mount_points():
        try:
            flags = os.statvfs(point).f_flag
        except OSError:
            continue
        kept = sum(bit for st, bit in _KEPT_FLAGS if flags & st)
        if not flags & (os.ST_NOATIME | os.ST_RELATIME):
            kept |= _MS_STRICTATIME
        libc.mount(None, point.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept, None)


def read_only_mounts(libc) -> None:
    """Every mount of this mount namespace read-only: its copies of the host's mounts, so the host's
    own stay as they are. One recursive mount_setattr (Linux 5.12), else `remount_read_only`."""
    attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)  # struct mount_attr: set, clear, propagation, userns
    if libc.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), b"/", ctypes.c_uint(_AT_RECURSIVE),
                    attr, ctypes.c_size_t(ctypes.sizeof(attr))) != 0:
        remount_read_only(libc)


def private_tmp(size_mb: int) -> str:
    """In this process's own mount namespace: every mount read-only, then one tmpfs of `size_mb`
    (their total cap) on /tmp with directories of it bound over the other PRIVATE_DIRS (/dev/shm,
    /var/tmp, /run/lock), and over /dev/mqueue, where there is one, the message queues of this
    process's IPC namespace. The sample can write nothing the host or a later sample sees, and
    everything it writes dies with the namespace. Returns the new working directory."""
    libc = _libc()
    read_only_mounts(libc)
    _mount(libc, b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=%dm,mode=1777" % size_mb)
    bound = {"/tmp"}
    for target in PRIVATE_DIRS[1:]:
        real = os.path.realpath(target)
        if real not in bound and os.path.isdir(real):
            bound.add(real)
            inner = "/tmp/.private" + real.replace("/", "_")
            os.mkdir(inner, 0o1777)
            _mount(libc, inner.encode(), real.encode(), None, _MS_BIND, None)
    if os.path.isdir("/dev/mqueue"):  # best effort: refused without an IPC namespace, and read-only anyway
        libc.mount(b"mqueue", b"/dev/mqueue", b"mqueue", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
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


def install_filter(program: list) -> None:
    """Install the seccomp program (classic BPF, [code, jt, jf, k] per instruction: the runner's
    `seccomp.memory_filter`, for a 64-bit ABI) for this process and all it starts, after
    no_new_privs, which an unprivileged filter needs."""
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise OSError(22, "the sandbox's seccomp filter is for a 64-bit interpreter")
    instructions = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in program))
    fprog = ctypes.create_string_buffer(struct.pack("@HP", len(program), ctypes.addressof(instructions)))
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(_PR_SET_SECCOMP, 2, fprog, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl: the seccomp filter was refused")


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
    """The globals the tests run in: the candidate's public names (the grader's stand-ins), minus
    any that shadow a builtin, and `pristine_builtins` (the grader's, which no candidate touched)."""
    namespace = {k: v for k, v in candidate.items() if not k.startswith("__") and k not in pristine_builtins}
    namespace.update(__name__="__tests__", __builtins__=pristine_builtins)
    return namespace


def run_statements(tests: list, namespace: dict) -> int:
    """Run the compiled test statements in `namespace` (in the grader's process, where no candidate
    code ever ran) and return how many tests passed. A failing test is reported and skipped; a
    failing setup statement (a def, an import) stops the rest, which could not run without it."""
    passed = 0
    for statement, test in tests:
        try:
            exec(statement, namespace)
        except BaseException as e:
            traceback.print_exception(e.__class__, e, e.__traceback__.tb_next)
            if not test:
                break
            continue
        passed += test
    return passed


def run_candidate(code, *, as_main: bool) -> dict:
    """Run `code` as `__main__` (a script, whose SystemExit is its exit status) or as module `solution`
    and return its namespace. On an error, report it and exit 1; so does a `solution` that exits (even
    with status 0): a candidate that never finishes its definitions fails every test."""
    name = "__main__" if as_main else "solution"
    module = types.ModuleType(name)
    module.__file__ = "solution.py"
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException as e:
        if as_main and isinstance(e, SystemExit):
            flush()
            os._exit(exit_code(e))
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        flush()
        os._exit(1)
    return module.__dict__


def grade(grader, tests_fd: int, status_fd: int, fds: tuple) -> None:
    """The grader's process (`grader.py`), forked before any candidate code exists: read the tests
    (only it has TESTS_FD), run them against the candidate's names as the grader's stand-ins, then
    the value tests' expressions, and write the report on STATUS_FD; never returns. No report when
    the candidate's code did not finish: the run then fails."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a candidate's SIGINT must not interrupt a test
    os.set_inheritable(status_fd, False)  # not for a process the tests might start
    payload = read_config(tests_fd)
    tests = parse_tests(payload["tests"])
    link = grader.Link(*fds)
    try:
        names = link.names()
    except Exception:  # noqa: BLE001 - the candidate failed, exited or sent junk
        flush()
        os._exit(1)
    namespace = tests_namespace(names, dict(builtins.__dict__))
    namespace.update(grader.stdlib_modules(payload["tests"]))
    passed = run_statements(tests, namespace)
    values = grader.run_calls(payload["calls"], namespace)
    flush()
    grader.write_report(status_fd, payload["nonce"], passed, sum(t for _, t in tests), values)
    link.close()
    os._exit(0)


def load_grader(path: str):
    """grader.py from the runner's copy at `path`, run as a module of its own: not importable by
    the candidate, and no bytecode cache written next to it."""
    module = types.ModuleType("sandbox_grader")
    with open(path, "rb") as f:
        exec(compile(f.read(), path, "exec"), module.__dict__)
    return module


def _set_up(config: dict) -> None:
    """Private temporary directories (with a mount namespace), no capabilities, limits,
    non-dumpable, the seccomp filter, network guard: everything before any candidate code exists."""
    if config.get("private_tmp_mb"):
        os.environ["HOME"] = os.environ["TMPDIR"] = private_tmp(config["private_tmp_mb"])
        drop_capabilities()
    for name, soft, hard in config["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    # Not dumpable (inherited by the fork): other processes of the same uid, such as concurrent
    # sandboxes, cannot ptrace this one or open its /proc/PID/fd and /proc/PID/mem.
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    if config.get("seccomp"):
        install_filter(config["seccomp"])
    guard_network()


def _child(config: dict, status_fd: int, control_fd: int, serve=None) -> None:
    """The forked child: compile and run the candidate, as `__main__`, or (with `serve`, which
    answers the grader) as module `solution`; never returns."""
    os.close(status_fd)
    os.close(control_fd)
    try:
        code = compile(config["code"], "solution.py", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        flush()
        os._exit(1)
    namespace = run_candidate(code, as_main=serve is None)
    if serve is None:
        sys.exit(0)  # normal interpreter shutdown: atexit handlers, non-daemon threads, flushing
    serve(namespace)
    flush()
    os._exit(0)


def _start_graded(grader, config: dict, status_fd: int, control_fd: int) -> list:
    """Fork the grader, then the candidate, joined by a pipe pair -> [candidate PID, grader PID]."""
    (to_candidate, from_grader), (to_grader, from_candidate) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (control_fd, to_candidate, from_candidate):
            os.close(fd)
        grade(grader, config["tests_fd"], status_fd, (to_grader, from_grader))
    os.close(config["tests_fd"])  # the candidate never has it
    candidate = os.fork()
    if candidate == 0:
        for fd in (to_grader, from_grader):
            os.close(fd)
        _child(config, status_fd, control_fd, lambda names: grader.serve(names, to_candidate, from_candidate))
    for fd in (to_candidate, from_grader, to_grader, from_candidate):
        os.close(fd)
    return [candidate, pid]


def _wait(pids: list, status_fd: int, control_fd: int) -> None:
    """Once every child has exited, report the first's (the candidate's) exit status; kill them all
    when the supervisor closes CONTROL_FD; then exit."""
    try:
        child_fds = {pid: os.pidfd_open(pid) for pid in pids}  # readable when that child exits
    except (AttributeError, OSError):
        child_fds = None  # an old kernel: poll
    codes = {}
    while True:
        for pid in pids:
            done, status = (0, 0) if pid in codes else os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) == len(pids):
            os.write(status_fd, b"X %d\n" % codes[pids[0]])
            os._exit(0)  # as PID 1 of the namespace: the kernel kills and reaps everything left in it
        watched = [control_fd] + ([] if child_fds is None else [child_fds[p] for p in pids if p not in codes])
        if control_fd in select.select(watched, [], [], 0.02 if child_fds is None else None)[0]:
            # The supervisor asks us to stop (timeout, output flood) or has gone away.
            for pid in pids:
                if pid not in codes:
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
    grader = load_grader(config["grader"]) if config.get("tests_fd") is not None else None
    # The runner's copies of this file and grader.py: gone before the candidate runs, so its cwd is empty.
    for path in config["unlink"]:
        os.unlink(path)
    _set_up(config)
    sys.argv = ["solution.py"]
    os.write(status_fd, b"S\n")
    if grader is not None:
        pids = _start_graded(grader, config, status_fd, control_fd)
    else:
        pids = [os.fork()]
        if pids[0] == 0:
            _child(config, status_fd, control_fd)
    config = None
    _wait(pids, status_fd, control_fd)


if __name__ == "__main__":
    main()
