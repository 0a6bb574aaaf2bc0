"""`RunLock`: one run per run directory.

`train` takes `RUN_DIR/run.lock` before it reads or writes anything there and gives it back when it
ends. The lock names its holder (process id, host, start time) and carries a lease that a thread of
the holder renews every `lease_s / 4` seconds. A second `train` on the directory is refused while
the holder lives: on the same host, while its process exists; on another host (a shared file system,
a bucket), while its lease is fresh. A lock whose holder is gone (a killed run) is taken over with a
notice. On a local disk the lock is created with O_EXCL, so two starts cannot both take it; on
remote storage (gs://..., through fsspec) an object store has no exclusive create, so the taker
writes its token and reads it back after a pause, and the later writer wins.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from grpo_jax.config import ConfigError

LOCK_FILE = "run.lock"
LEASE_S = 600.0


class RunDirectoryBusy(ConfigError):
    """Another live run holds the run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """The run directory `target` (a local path or an fsspec URL) for this process, or a
    RunDirectoryBusy naming the live run that holds it. `hold=False` (a run's other processes:
    process 0 holds the lock for all) makes it do nothing."""

    def __init__(self, target: str | os.PathLike, *, log: Callable[[str], None], lease_s: float = LEASE_S,
                 settle_s: float = 1.0, hold: bool = True):
        self.hold = hold
        self.target, self.log, self.lease_s, self.settle_s = str(target).rstrip("/"), log, lease_s, settle_s
        self.remote = "://" in self.target
        if self.remote:
            import fsspec

            self._fs, root = fsspec.core.url_to_fs(self.target)
            self._path = f"{root}/{LOCK_FILE}"
        else:
            self._path = str(Path(self.target) / LOCK_FILE)
        self.token = uuid.uuid4().hex
        self.held = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _record(self) -> dict:
        now = time.time()
        return {"pid": os.getpid(), "host": socket.gethostname(), "token": self.token, "renewed": now,
                "started": getattr(self, "_started", now)}

    def _read(self) -> dict | None:
        try:
            text = self._fs.cat_file(self._path).decode() if self.remote else Path(self._path).read_text()
            holder = json.loads(text)
            return holder if isinstance(holder, dict) else {}
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            return {}  # a half-written or foreign file: no holder to respect

    def _write(self, record: dict, *, exclusive: bool) -> bool:
        data = json.dumps(record)
        if self.remote:
            self._fs.pipe_file(self._path, data.encode())
            return True
        Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        if exclusive:
            try:
                fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(data)
            return True
        tmp = f"{self._path}.{self.token}"
        Path(tmp).write_text(data)
        os.replace(tmp, self._path)
        return True

    def _alive(self, holder: dict) -> bool:
        fresh = time.time() - float(holder.get("renewed", 0)) < self.lease_s
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            return holder["pid"] != os.getpid() and _pid_alive(holder["pid"]) and fresh
        return fresh

    @staticmethod
    def describe(holder: dict) -> str:
        started = holder.get("started")
        when = (datetime.fromtimestamp(started, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
                if isinstance(started, (int, float)) else "an unknown time")
        return f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"

    def acquire(self) -> RunLock:
        """Take the lock (a stale one with a notice), or raise RunDirectoryBusy."""
        if not self.hold:
            return self
        self._started = time.time()
        for _ in range(3):
            holder = self._read()
            if holder is not None:
                if holder and self._alive(holder):
                    raise RunDirectoryBusy(
                        f"run directory {self.target} is in use by a live run ({self.describe(holder)}); wait "
                        f"for it to end, stop it, or choose another --output")
                self.log(f"run directory {self.target}: taking over the lock of a run that is gone "
                         f"({self.describe(holder) if holder else 'unreadable lock'})")
                self._remove()
            if not self._write(self._record(), exclusive=True):
                continue  # another start took it in between: look again
            if self.remote:
                time.sleep(self.settle_s)
                if (self._read() or {}).get("token") != self.token:
                    continue
            self.held = True
            self._renewer = threading.Thread(target=self._renew, name="run-lock", daemon=True)
            self._renewer.start()
            return self
        holder = self._read() or {}
        raise RunDirectoryBusy(f"run directory {self.target} is being taken by another run "
                               f"({self.describe(holder)}); choose another --output")

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                if (self._read() or {}).get("token") == self.token:
                    self._write(self._record(), exclusive=False)
            except OSError:
                pass  # the next renewal tries again; a lapsed lease only lets a later start take over

    def _remove(self) -> None:
        try:
            if self.remote:
                self._fs.rm_file(self._path)
            else:
                os.unlink(self._path)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        """Give the lock back (only if this process still holds it)."""
        if not self.held:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if (self._read() or {}).get("token") == self.token:
            self._remove()
        self.held = False
