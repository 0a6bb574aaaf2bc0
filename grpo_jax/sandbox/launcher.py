"""Finding how to start a sandbox on this machine (the measures: see `grpo_jax.sandbox`).

The launcher is found once per interpreter choice by probing the strongest isolation first: user,
network, mount, PID and IPC namespaces (`unshare`), then the same without IPC, then none; as root the
sandbox user is `nobody`. With namespaces the probe runs the harness's own set-up
(`harness.private_tmp`: every mount read-only, private temporary directories) and reports any mount
it left writable; with those and the SysV IPC and message queues of a sandbox without an IPC
namespace, that is what a sample can write that the host and later samples share
(`sandbox_shared`, logged at start). `runner.run_sandboxed` starts every run with the launcher found here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading

from grpo_jax.sandbox.seccomp import memory_filter

log = logging.getLogger(__name__)

_SANDBOX_UID = 65534  # nobody: used only when this process is root
_UNSHARE_ARGS = ("--user", "--map-root-user", "--net", "--mount", "--pid", "--ipc", "--fork", "--kill-child",
                 "--mount-proc", "--")
_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
_SHARED_IPC = "SysV IPC and POSIX message queues (no IPC namespace)"
# Directories commonly world-writable on a host: where a sandbox without a mount namespace shares them.
_HOST_SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")
# Run in the sandbox with harness.py on stdin: the harness's own set-up, then, as a JSON list of
# "mount point (fstype)", the mounts it left writable that were there before it (not its private
# tmpfs) and that a path reaches (not one hidden under another mount at the same place).
_PROBE = r"""
import json, os, resource, socket, sys
harness = {"__name__": "sandbox_probe"}
exec(compile(sys.stdin.read(), "harness.py", "exec"), harness)
def mounts():
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    points = dict(zip((r[0] for r in rows), harness["mount_points"]()))
    return {r[0]: (points[r[0]], r[5].split(","), r[r.index("-") + 1]) for r in rows}
def reached(point):
    try:
        fd = os.open(point, os.O_PATH)
    except OSError:
        return None  # not even reachable by the sandbox user
    try:
        with open("/proc/self/fdinfo/%d" % fd) as f:
            return next((line.split()[1] for line in f if line.startswith("mnt_id:")), "?")
    finally:
        os.close(fd)
before = mounts()
harness["private_tmp"](1)
after = mounts()
print(json.dumps(sorted("%s (%s)" % (p, t) for i, (p, o, t) in after.items()
                        if i in before and "rw" in o and reached(p) in (i, "?"))))
"""
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"  # the only PATH a sandbox (or a probe of one) sees


@dataclasses.dataclass(frozen=True)
class Launcher:
    """How to start a sandbox here: the command prefix, the interpreter, the user, and the
    isolation measures they give."""

    prefix: tuple[str, ...]  # the unshare command, or () without namespaces
    python: str
    uid: int | None
    isolation: tuple[str, ...]
    shared: tuple[str, ...] = ()  # what a sample can write that the host and later samples see


class SandboxUnavailable(RuntimeError):
    """No way to start a sandbox on this machine (every launcher probed failed)."""


_launchers: dict[str | None, Launcher] = {}
_launchers_lock = threading.Lock()


def user_kwargs(uid: int | None) -> dict:
    """`subprocess` keyword arguments that run a child as `uid` (none for None: this user)."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _probe(argv: list[str], uid: int | None, stdin: bytes = b"") -> tuple[str, str | None]:
    """(stdout, None) if `argv` runs and exits 0 as the sandbox user, else ("", why not)."""
    try:
        r = subprocess.run(argv, input=stdin, capture_output=True, timeout=30, cwd="/", env={"PATH": SAFE_PATH},
                           **user_kwargs(uid))
    except (OSError, subprocess.SubprocessError) as e:
        return "", f"{argv[0]}: {type(e).__name__}: {e}"
    if r.returncode != 0:
        return "", f"{' '.join(argv[:2])}...: exit {r.returncode}: {r.stderr.decode(errors='replace').strip()[-300:]}"
    return r.stdout.decode(errors="replace"), None


def _probe_sandbox(prefix: tuple[str, ...], python: str, uid: int | None) -> tuple[tuple[str, ...] | None, str | None]:
    """Start a sandbox with `prefix` and `python` as `uid` -> (the mounts it left writable and
    shared with the host, None), or (None, why it does not start). Without a prefix: () or the error."""
    if not prefix:
        error = _probe([python, "-I", "-c", "import resource, socket"], uid)[1]
        return (None, error) if error else ((), None)
    try:
        with open(_HARNESS, "rb") as f:
            source = f.read()
    except OSError as e:
        return None, f"{_HARNESS}: {e}"
    out, error = _probe([*prefix, python, "-I", "-c", _PROBE], uid, source)
    if error:
        return None, error
    try:
        mounts = json.loads(out.splitlines()[-1])
    except (IndexError, ValueError):
        return None, f"the sandbox probe printed {out[-300:]!r}"
    return tuple(mounts), None


# Installs the seccomp filter (argv[1], JSON) the way the harness does, then checks that memfd_create
# is refused: a kernel or a container policy may refuse filters, or a 32-bit interpreter not fit one.
_SECCOMP_PROBE = r"""
import errno, json, os, sys
harness = {"__name__": "sandbox_probe"}
exec(compile(sys.stdin.read(), "harness.py", "exec"), harness)
harness["install_filter"](json.loads(sys.argv[1]))
try:
    os.close(os.memfd_create("probe"))
except OSError as e:
    sys.exit(0 if e.errno == errno.ENOSYS else 1)
sys.exit("memfd_create was not refused")
"""


def _seccomp_works(prefix: tuple[str, ...], python: str, uid: int | None) -> str | None:
    """None if a sandbox started with `prefix` and `python` as `uid` installs the memory filter and
    it refuses memfd_create, else why not (no filter for this machine counts as not working)."""
    program = memory_filter()
    if program is None:
        return f"no seccomp filter for {platform.machine()}"
    try:
        with open(_HARNESS, "rb") as f:
            source = f.read()
    except OSError as e:
        return f"{_HARNESS}: {e}"
    return _probe([*prefix, python, "-I", "-c", _SECCOMP_PROBE, json.dumps(program)], uid, source)[1]


def _host_shared(uid: int | None) -> tuple[str, ...]:
    """What a sandbox without namespaces shares with the host: everything its user can write,
    named by the usual world-writable directories that exist here, and SysV IPC."""
    dirs = []
    for path in _HOST_SHARED_DIRS:
        real = os.path.realpath(path)
        try:
            writable = os.path.isdir(real) and os.stat(real).st_mode & 0o002
        except OSError:
            continue
        if writable and real not in dirs:
            dirs.append(real)
    user = "this user" if uid is None else f"uid={uid}"
    return (*dirs, f"every other file and directory {user} can write (no mount namespace)", _SHARED_IPC)


def _find_unshare() -> str | None:
    return shutil.which("unshare", path=SAFE_PATH)


def find_launcher(python: str | None) -> Launcher:
    """How to start a sandbox here, found once per interpreter choice by trying the strongest
    isolation first: namespaces before none, then `python` (default this interpreter) before the
    system python3 (root's interpreter may live where `nobody` cannot read it). Raises
    SandboxUnavailable when nothing works."""
    with _launchers_lock:
        if python in _launchers:
            return _launchers[python]
        uid = _SANDBOX_UID if os.geteuid() == 0 else None
        pythons = [python] if python else [sys.executable]
        system_python = shutil.which("python3", path=SAFE_PATH)
        if python is None and uid is not None and system_python and system_python not in pythons:
            pythons.append(system_python)
        unshare = _find_unshare()
        without_ipc = tuple(a for a in _UNSHARE_ARGS if a != "--ipc")
        prefixes = ([(unshare, *_UNSHARE_ARGS), (unshare, *without_ipc)] if unshare else []) + [()]
        errors = []
        for prefix in prefixes:
            for py in pythons:
                mounts, error = _probe_sandbox(prefix, py, uid)
                if error:
                    errors.append(error)
                    continue
                launcher = _launcher(prefix, py, uid, mounts)
                if errors:
                    log.warning("code sandbox: using %s with isolation %s; the options tried first failed: %s",
                                py, ", ".join(launcher.isolation), "; ".join(errors))
                if launcher.shared:
                    log.warning("code sandbox: a sample can write what the host and later samples see: %s",
                                "; ".join(launcher.shared))
                _launchers[python] = launcher
                return launcher
        raise SandboxUnavailable("no way to start a sandbox here: " + "; ".join(errors))


def _launcher(prefix: tuple[str, ...], python: str, uid: int | None, mounts: tuple[str, ...]) -> Launcher:
    """The launcher for a probed `prefix`, whose set-up left `mounts` writable and shared."""
    if not prefix:
        shared = _host_shared(uid)
    else:
        shared = mounts + (() if "--ipc" in prefix else (_SHARED_IPC,))
    return Launcher(prefix=tuple(prefix), python=python, uid=uid, isolation=_isolation(prefix, uid, mounts, python=python),
                    shared=shared)


def _isolation(prefix: tuple[str, ...], uid: int | None, mounts: tuple[str, ...] = (), *,
               python: str = sys.executable) -> tuple[str, ...]:
    """The measures a sandbox started with `prefix` as `uid` gets (`mounts`: those its set-up left
    writable and shared with the host)."""
    isolation = ("session", "rlimits", "socket-guard")
    if (why := _seccomp_works(prefix, python, uid)) is None:
        isolation += ("seccomp",)
    else:  # memfd and SysV memory outside the caps stay possible: say so once
        log.warning("code sandbox: no seccomp memory filter (%s): a sample can hold memory outside its caps "
                    "through memfd_create or shmget", why)
    if prefix:
        isolation += ("userns", "netns", "mountns", "pidns")
        if "--ipc" in prefix:
            isolation += ("ipcns",)
        isolation += ("private-tmp",) if mounts else ("private-tmp", "read-only-root")
    if uid is not None:
        isolation += (f"uid={uid}",)
    if prefix or uid is not None:
        isolation += ("nproc",)
    return isolation


def sandbox_isolation(python: str | None = None) -> tuple[str, ...]:
    """The isolation measures `run_sandboxed` applies on this machine (log it at startup), e.g.
    ('session', 'rlimits', 'socket-guard', 'seccomp', 'userns', 'netns', 'mountns', 'pidns', 'ipcns', 'private-tmp',
    'read-only-root', 'uid=65534', 'nproc'). Raises RuntimeError when no sandbox can be started at all."""
    return find_launcher(python).isolation


def sandbox_shared(python: str | None = None) -> tuple[str, ...]:
    """What a sample can write on this machine that the host and later samples see (log it at
    startup): () with every namespace; else e.g. a mount that stayed writable, "/ (ext4)", or
    "SysV IPC and POSIX message queues (no IPC namespace)". Raises RuntimeError as `sandbox_isolation`."""
    return find_launcher(python).shared
