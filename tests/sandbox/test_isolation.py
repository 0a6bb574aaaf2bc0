"""Samples cannot pass anything to later samples, and leave nothing behind: the sandbox's own IPC
namespace (SysV message queues, shared memory, semaphores, POSIX message queues), private /tmp,
/dev/shm, /var/tmp and /run/lock, every other mount read-only; and where a namespace is missing,
the start-up log says what is shared.

Each channel is tried the way a reward hack would: a correct sample stashes its results, a later
sample without an implementation looks for them. A few sandbox runs in all: seconds on 2 cores.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import textwrap

import pytest

from grpo_jax.rewards import code_reward
from grpo_jax.rewards.registry import build_spec, sandbox_notes
from grpo_jax.sandbox import harness, launcher, run_sandboxed, sandbox_isolation, sandbox_shared

DIRS = ("/tmp", "/dev/shm", "/var/tmp", "/run/lock", "/var/lock")
CHANNELS = (*DIRS, "msg", "shm", "sem", "mq")
ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 0) == 10"

# Stashing a value in every channel and finding it again: standard library only (ctypes on libc),
# run in the sandbox by the samples and in this process to look for leftovers and remove them.
CHANNELS_LIB = """
import ctypes, ctypes.util, os
_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = ctypes.c_void_p
try:
    _libc.mq_open
    _rt = _libc
except AttributeError:  # glibc before 2.34
    _rt = ctypes.CDLL(ctypes.util.find_library("rt"), use_errno=True)
KEY, TAG, MQ = {key}, {tag!r}, {mq!r}
DIRS = {dirs!r}
IPC_CREAT, IPC_NOWAIT, IPC_RMID, GETVAL, SETVAL = 0o1000, 0o4000, 0, 12, 16

def _path(i):
    return os.path.join(DIRS[i], "%s_%d" % (TAG, i))

def _why(ok):
    return "stashed" if ok else os.strerror(ctypes.get_errno())

def stash(value):
    done = {{}}
    for i, d in enumerate(DIRS):
        try:
            with open(_path(i), "w") as f:
                f.write(str(value))
            done[d] = "stashed"
        except OSError as e:
            done[d] = e.strerror
    msq = _libc.msgget(KEY, IPC_CREAT | 0o666)
    msg = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + 8)
    ctypes.c_long.from_buffer(msg).value = 1
    msg[ctypes.sizeof(ctypes.c_long)] = bytes([value])
    done["msg"] = _why(msq >= 0 and _libc.msgsnd(msq, msg, 8, 0) == 0)
    shm = _libc.shmget(KEY, 4096, IPC_CREAT | 0o666)
    addr = _libc.shmat(shm, None, 0) if shm >= 0 else None
    if addr not in (None, 2 ** 64 - 1):
        ctypes.c_int.from_address(addr).value = value
    done["shm"] = _why(addr not in (None, 2 ** 64 - 1))
    sem = _libc.semget(KEY, 1, IPC_CREAT | 0o666)
    done["sem"] = _why(sem >= 0 and _libc.semctl(sem, 0, SETVAL, value) == 0)
    mqd = _rt.mq_open(MQ.encode(), os.O_CREAT | os.O_RDWR, 0o666, None)
    done["mq"] = _why(mqd >= 0 and _rt.mq_send(mqd, bytes([value]), 1, 0) == 0)
    return done

def find(remove=False):
    found = {{}}
    for i, d in enumerate(DIRS):
        try:
            with open(_path(i)) as f:
                found[d] = int(f.read())
            if remove:
                os.unlink(_path(i))
        except OSError:
            found[d] = None
    found["msg"] = found["shm"] = found["sem"] = found["mq"] = None
    msq = _libc.msgget(KEY, 0)
    if msq >= 0:
        msg = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + 8)
        if _libc.msgrcv(msq, msg, 8, 0, IPC_NOWAIT) >= 0:
            found["msg"] = msg.raw[ctypes.sizeof(ctypes.c_long)]
        if remove:
            _libc.msgctl(msq, IPC_RMID, None)
    shm = _libc.shmget(KEY, 0, 0)
    if shm >= 0:
        addr = _libc.shmat(shm, None, 0)
        if addr not in (None, 2 ** 64 - 1):
            found["shm"] = ctypes.c_int.from_address(addr).value
        if remove:
            _libc.shmctl(shm, IPC_RMID, None)
    sem = _libc.semget(KEY, 0, 0)
    if sem >= 0:
        found["sem"] = _libc.semctl(sem, 0, GETVAL)
        if remove:
            _libc.semctl(sem, 0, IPC_RMID)
    mqd = _rt.mq_open(MQ.encode(), os.O_RDONLY | os.O_NONBLOCK)
    if mqd >= 0:
        buf = ctypes.create_string_buffer(1 << 20)
        if _rt.mq_receive(mqd, buf, len(buf), None) >= 0:
            found["mq"] = buf.raw[0]
        if remove:
            _rt.mq_unlink(MQ.encode())
    return found
"""

isolated = pytest.mark.skipif(not {"mountns", "ipcns"} <= set(sandbox_isolation()),
                              reason="no mount or IPC namespace here (the start-up log says so: see the tests of "
                                     "the degraded launchers below)")


def fenced(code: str) -> str:
    return f"```python\n{textwrap.dedent(code).strip()}\n```"


def sysvipc(uid: int) -> set[tuple[str, str]]:
    """(table, line) of every SysV IPC object here owned by `uid` (/proc/sysvipc: what `ipcs` reads)."""
    objects = set()
    for table in ("msg", "shm", "sem"):
        with open(f"/proc/sysvipc/{table}") as f:
            header, *rows = [line.split() for line in f]
        for row in rows:
            if int(row[header.index("uid")]) == uid:
                objects.add((table, row[header.index("key")] + " " + row[1]))
    return objects


def leftovers(tag: str) -> list[str]:
    return sorted(os.path.join(d, name) for d in DIRS if os.path.isdir(d) for name in os.listdir(d) if tag in name)


@pytest.fixture
def channels():
    """The channels' library for one test: a fresh key, file tag and queue name; afterwards
    whatever a failed isolation left on the host is removed."""
    tag = f"grpo_isolation_{secrets.token_hex(4)}"
    lib = CHANNELS_LIB.format(key=secrets.randbelow(1 << 30) + 1, tag=tag, mq=f"/{tag}", dirs=DIRS)
    host: dict = {}
    exec(compile(lib, "channels", "exec"), host)
    uid = launcher.find_launcher(None).uid
    ipc_before = sysvipc(os.getuid() if uid is None else uid)
    yield lib, tag, host
    left = host["find"](remove=True)
    ipc_after = sysvipc(os.getuid() if uid is None else uid)
    assert left == dict.fromkeys(CHANNELS), left  # nothing reached the host
    assert ipc_after <= ipc_before, ipc_after - ipc_before  # as `ipcs` shows it
    assert leftovers(tag) == []


@isolated
def test_what_a_sample_stashes_no_later_sample_sees_and_nothing_outlives_it(channels):
    lib, _, _ = channels
    r = run_sandboxed(lib + "import json\nprint(json.dumps([stash(5), find()]))", timeout_s=10)
    assert r.status == "ok", r
    stashed, found = json.loads(r.stdout)
    # Every channel works inside a sample but SysV shared memory, which the seccomp filter refuses
    # (memory outside the sample's caps: grpo_jax.sandbox.seccomp).
    refused = {"shm": os.strerror(38)} if "seccomp" in r.isolation else {}
    assert stashed == {**dict.fromkeys(CHANNELS, "stashed"), **refused}, stashed
    assert found == {**dict.fromkeys(CHANNELS, 5), **dict.fromkeys(refused)}, found
    r = run_sandboxed(lib + "import json\nprint(json.dumps(find()))", timeout_s=10)
    assert r.status == "ok", r
    assert json.loads(r.stdout) == dict.fromkeys(CHANNELS), r.stdout  # the next sample sees none of it


@isolated
def test_a_sample_without_an_implementation_cannot_use_a_correct_samples_results(channels):
    """The hack: a correct sample stashes its results, a later one returns what it finds. The
    control (the correct sample itself) still scores 1."""
    lib, _, _ = channels
    correct = lib + "\ndef add(a, b):\n    stash(a + b)\n    return a + b"
    cheat = lib + "\ndef add(a, b):\n    return next((v for v in find().values() if v is not None), None)"
    scores = code_reward(["q"] * 2, [fenced(correct), fenced(cheat)], tests=[ADD_TESTS] * 2, max_workers=1)
    assert scores == [1.0, 0.0]


@isolated
def test_every_other_directory_is_read_only_in_the_sandbox():
    """A world-writable directory outside the private ones (made here, where the sandbox user can
    reach it: as root under /srv, else the home directory) is read-only inside; a normal program
    still writes its own cwd and /tmp."""
    path = tempfile.mkdtemp(prefix="grpo_isolation_", dir="/srv" if os.geteuid() == 0 else os.path.expanduser("~"))
    try:
        os.chmod(path, 0o1777)
        source = textwrap.dedent(f"""
            for target in ({os.path.join(path, "f")!r}, "here", "/tmp/mine"):
                try:
                    with open(target, "w") as f:
                        f.write("x")
                    print(target, "written")
                except OSError as e:
                    print(target, e.strerror)
        """)
        r = run_sandboxed(source, timeout_s=10)
        assert r.status == "ok", r
        assert r.stdout.splitlines() == [f"{path}/f Read-only file system", "here written", "/tmp/mine written"]
        assert os.listdir(path) == []
    finally:
        shutil.rmtree(path, ignore_errors=True)


@isolated
def test_the_run_logs_the_isolation_and_that_nothing_writable_is_shared():
    isolation = sandbox_isolation()
    assert {"ipcns", "private-tmp", "read-only-root"} <= set(isolation) and sandbox_shared() == ()
    notes = sandbox_notes([build_spec("code", {}, 0.0, ("rewards[0].name", "rewards[0].kwargs"))])
    assert notes == [f"code sandbox isolation: {', '.join(isolation)}; writable and shared with the host: nothing"]


def probe(harness_source: str) -> list[str]:
    """The launcher's probe of this machine's sandbox, run with `harness_source`: the mounts its
    set-up leaves writable and shared with the host."""
    found = launcher.find_launcher(None)
    out, error = launcher._probe([*found.prefix, found.python, "-I", "-c", launcher._PROBE], found.uid,
                                 harness_source.encode())
    assert error is None, error
    return json.loads(out)


@isolated
def test_the_read_only_fallback_leaves_no_reachable_mount_writable():
    """Before Linux 5.12 (no mount_setattr: here its call fails) each mount is remounted read-only
    on its own, keeping its flags; a mount hidden under another is out of reach and not counted.
    The control: with no remount either, the probe reports the writable root."""
    with open(harness.__file__, encoding="utf-8") as f:
        source = f.read()
    setattr_line = "_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442,"
    assert setattr_line in source
    no_setattr = source.replace(setattr_line, setattr_line.replace("442", "-1"))  # ENOSYS
    assert probe(source) == [] and probe(no_setattr) == []
    no_remount = no_setattr.replace("def remount_read_only(libc) -> None:\n",
                                    "def remount_read_only(libc) -> None:\n    return\n")
    assert any(m.startswith("/ (") for m in probe(no_remount)), probe(no_remount)


@isolated
def test_mount_points_are_read_back_with_spaces_and_backslashes():
    found = launcher.find_launcher(None)
    odd = "/tmp/a b\\c"
    script = textwrap.dedent(f"""
        import json, os, sys
        h = {{"__name__": "test"}}
        exec(compile(sys.stdin.read(), "harness.py", "exec"), h)
        libc = h["_libc"]()
        h["_mount"](libc, b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=1m")
        os.mkdir({odd!r})
        h["_mount"](libc, b"tmpfs", {odd.encode()!r}, b"tmpfs", 0, b"size=1m")
        print(json.dumps(h["mount_points"]()))
    """)
    with open(harness.__file__, "rb") as f:
        source = f.read()
    r = subprocess.run([*found.prefix, found.python, "-I", "-c", script], input=source, capture_output=True,
                       timeout=30, cwd="/", env={"PATH": launcher.SAFE_PATH}, **launcher.user_kwargs(found.uid))
    assert r.returncode == 0, r.stderr.decode()
    assert odd in json.loads(r.stdout) and "/tmp" in json.loads(r.stdout)


# --- degraded launchers -----------------------------------------------------------------------------------

@pytest.fixture
def fresh_launchers(monkeypatch):
    monkeypatch.setattr(launcher, "_launchers", {})
    return monkeypatch


@pytest.mark.skipif("mountns" not in sandbox_isolation(), reason="no mount namespace here")
def test_without_an_ipc_namespace_the_sandbox_runs_and_the_log_says_ipc_is_shared(fresh_launchers, caplog):
    probe = launcher._probe

    def no_ipc(argv, uid, stdin=b""):
        return ("", "unshare: unshare failed: Invalid argument") if "--ipc" in argv else probe(argv, uid, stdin)

    fresh_launchers.setattr(launcher, "_probe", no_ipc)
    with caplog.at_level(logging.WARNING, logger=launcher.__name__):
        isolation = sandbox_isolation()
    assert "ipcns" not in isolation and {"mountns", "pidns", "read-only-root"} <= set(isolation)
    assert sandbox_shared() == ("SysV IPC and POSIX message queues (no IPC namespace)",)
    assert "unshare failed: Invalid argument" in caplog.text and "SysV IPC" in caplog.text
    [note] = sandbox_notes([build_spec("code", {}, 0.0, ("rewards[0].name", "rewards[0].kwargs"))])
    assert note.endswith("writable and shared with the host: SysV IPC and POSIX message queues (no IPC namespace)")
    assert run_sandboxed("print(1)", timeout_s=5).stdout == "1\n"


def test_without_namespaces_the_log_lists_the_shared_directories(fresh_launchers):
    fresh_launchers.setattr(launcher, "_find_unshare", lambda: None)
    shared = sandbox_shared()
    assert "/tmp" in shared and "/var/tmp" in shared and shared[-1].startswith("SysV IPC")
    assert any(s.startswith("every other file and directory") for s in shared)
    if os.path.isdir("/run/lock") and os.stat("/run/lock").st_mode & 0o002:
        assert "/run/lock" in shared and "/var/lock" not in shared  # one directory, named once
