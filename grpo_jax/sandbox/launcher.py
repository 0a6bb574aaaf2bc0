"""Finding how to start a sandbox on this machine (the measures: see `grpo_jax.sandbox`).

The launcher is found once per interpreter choice by probing the strongest isolation first: user,
network, mount and PID namespaces (`unshare`) before none, and as root the sandbox user `nobody`.
`runner.run_sandboxed` starts every run with the launcher found here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

_SANDBOX_UID = 65534  # nobody: used only when this process is root
_UNSHARE_ARGS = ("--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"  # the only PATH a sandbox (or a probe of one) sees


@dataclasses.dataclass(frozen=True)
class Launcher:
    """How to start a sandbox here: the command prefix, the interpreter, the user, and the
    isolation measures they give."""

    prefix: tuple[str, ...]  # the unshare command, or () without namespaces
    python: str
    uid: int | None
    isolation: tuple[str, ...]


class SandboxUnavailable(RuntimeError):
    """No way to start a sandbox on this machine (every launcher probed failed)."""


_launchers: dict[str | None, Launcher] = {}
_launchers_lock = threading.Lock()


def user_kwargs(uid: int | None) -> dict:
    """`subprocess` keyword arguments that run a child as `uid` (none for None: this user)."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _probe(argv: list[str], uid: int | None) -> str | None:
    """None if `argv` runs and exits 0 as the sandbox user, else why not."""
    try:
        r = subprocess.run(argv, capture_output=True, timeout=30, cwd="/", env={"PATH": SAFE_PATH}, **user_kwargs(uid))
    except (OSError, subprocess.SubprocessError) as e:
        return f"{argv[0]}: {type(e).__name__}: {e}"
    if r.returncode != 0:
        return f"{' '.join(argv[:2])}...: exit {r.returncode}: {r.stderr.decode(errors='replace').strip()[-300:]}"
    return None


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
        prefixes = ([(unshare, *_UNSHARE_ARGS)] if unshare else []) + [()]
        errors = []
        for prefix in prefixes:
            for py in pythons:
                error = _probe([*prefix, py, "-I", "-c", "import resource, socket"], uid)
                if error:
                    errors.append(error)
                    continue
                launcher = Launcher(prefix=tuple(prefix), python=py, uid=uid, isolation=_isolation(prefix, uid))
                if errors:
                    log.warning("code sandbox: using %s with isolation %s; the options tried first failed: %s",
                                py, ", ".join(launcher.isolation), "; ".join(errors))
                _launchers[python] = launcher
                return launcher
        raise SandboxUnavailable("no way to start a sandbox here: " + "; ".join(errors))


def _isolation(prefix: tuple[str, ...], uid: int | None) -> tuple[str, ...]:
    """The measures a sandbox started with `prefix` as `uid` gets."""
    isolation = ("session", "rlimits", "socket-guard")
    if prefix:
        isolation += ("userns", "netns", "mountns", "pidns")
    if uid is not None:
        isolation += (f"uid={uid}",)
    if prefix or uid is not None:
        isolation += ("nproc",)
    return isolation


def sandbox_isolation(python: str | None = None) -> tuple[str, ...]:
    """The isolation measures `run_sandboxed` applies on this machine (log it at startup), e.g.
    ('session', 'rlimits', 'socket-guard', 'userns', 'netns', 'mountns', 'pidns', 'uid=65534', 'nproc').
    Raises RuntimeError when no sandbox can be started at all."""
    return find_launcher(python).isolation
