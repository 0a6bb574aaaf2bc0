"""User code named in the config (`module:Class`, `path/to/file.py:function`) runs in worker
processes, where a call that hangs can be ended: the trainer never waits on it past its time
limit, holds no thread for it, and ends its process.

`Workers(name, kwargs, size=K)` keeps up to K worker processes for one user object (an
environment class, each instance living in one worker, named by a key; or a reward function).
Each worker loads the object itself (`load_user_object`), runs every call on a thread of its own
(so the environments of many episodes step side by side in one worker) and answers through a pipe
that the trainer reads when it looks (`Call.ready`, `Call.result`): no thread of the trainer waits
on a worker. A call past its time limit retires its worker: it takes nothing new, finishes what
its other callers started, and is killed (with every process it started: it runs in a session of
its own) once nothing of it is in use; a replacement starts when needed. Retired workers beyond K
are killed at once. A worker that dies (a crash, the OOM killer) fails the calls it held and the
instances it kept, nothing else. A worker is a fresh interpreter (never a fork of the trainer's
threads, and it never imports the trainer's main module), in a session of its own (the terminal's
Ctrl-C is the trainer's to handle), on the CPU as far as JAX goes (the trainer holds the
accelerator), and exits when the trainer's end of its pipe closes.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

from grpo_jax.usercode.calls import Call, done_call


class WorkerLost(RuntimeError):
    """The worker process that held a call or an environment ended (crashed, was killed)."""


LOAD_TIMEOUT_S = 300.0  # a worker's start: a fresh interpreter importing the user's module (torch, say)


class _Proc:
    def __init__(self, process, conn):
        self.process, self.conn = process, conn
        self.spawned, self.loaded = time.monotonic(), None  # when it started, when it had loaded the object
        self.pending: set[int] = set()  # call ids in flight
        self.keys: set = set()  # the instances it keeps
        self.retired = False
        self.lost: str | None = None  # why it is gone
        # Calls go out through a thread of its own: a worker that stops reading (its GIL held by a
        # hung call) fills the pipe, which must block that thread, never the trainer's.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_write, args=(self.conn, self.outbox), daemon=True, name="grpo-jax-worker-pipe").start()

    def send(self, message) -> None:
        """Queue `message` for the worker (pickled now: an argument that does not pickle raises here)."""
        self.outbox.put(bytes(ForkingPickler.dumps(message)))

    @property
    def load(self) -> int:
        return len(self.pending) + len(self.keys)


def _write(conn, outbox: queue.SimpleQueue) -> None:
    while (payload := outbox.get()) is not None:
        try:
            conn.send_bytes(payload)
        except (OSError, TypeError, ValueError):
            # The worker is gone or its pipe closed (by the trainer, while this thread was sending:
            # the connection's handle is then None): the poller finds it lost.
            return


class RemoteCall(Call):
    def __init__(self, workers: Workers, proc: _Proc, key, convert=None):
        super().__init__(convert)
        self.workers, self.proc, self.key = workers, proc, key

    def poll(self) -> None:
        self.workers.poll()

    def wait_some(self, seconds: float) -> None:
        self.workers.wait(seconds)

    def expired(self) -> None:
        self.workers.give_up(self, hung=True)

    def abandoned(self) -> None:
        self.workers.give_up(self, hung=False)

    def left(self, timeout_s: float) -> float:
        """The time limit counts from when the worker had loaded the object (a new worker's start
        is not the call's), which gets LOAD_TIMEOUT_S."""
        loaded = self.proc.loaded
        if loaded is None:
            return timeout_s if time.monotonic() - self.proc.spawned < LOAD_TIMEOUT_S else 0.0
        return max(self.started, loaded) + timeout_s - time.monotonic()

    def late(self, timeout_s: float) -> str:
        if self.proc.loaded is None:
            return f"its worker process did not load {self.workers.name} within {LOAD_TIMEOUT_S:g} s"
        return super().late(timeout_s)


class Workers:
    """Up to `size` worker processes for the user object `name` (with `kwargs`: a class's
    constructor arguments, or those bound to a function); `what`/`member` name it in messages."""

    def __init__(self, name: str, kwargs: Mapping[str, Any] | None = None, *, size: int = 2,
                 what: str = "environment", member: str = "class"):
        if size < 1:
            raise ValueError(f"{what} workers: size must be >= 1, got {size}")
        self.name, self.kwargs, self.size, self.what, self.member = name, dict(kwargs or {}), size, what, member
        self.live: list[_Proc] = []
        self.retired: list[_Proc] = []
        self.calls: dict[int, RemoteCall] = {}
        self.keys: dict[Any, _Proc] = {}
        self.ids = itertools.count()
        self.started = 0  # worker processes started, over the pool's life
        self.lock = threading.RLock()
        self._all: list[_Proc] = []  # every process not yet killed, for the finalizer
        weakref.finalize(self, _kill_all, self._all)

    # --- calls ------------------------------------------------------------------------------------
    def start(self, method: str | None, args: Sequence = (), kwargs: Mapping | None = None, *, key=None,
              make: bool = False, attrs: Sequence[str] = (), convert=None) -> Call:
        """Call `method` of the instance `key` (`make`: build it first, on a worker chosen now;
        `attrs`: also return these attributes of it) or, `key` None, the object itself with
        `args` and `kwargs` -> the call (already failed when no worker can take it)."""
        with self.lock:
            if key is not None and not make:
                proc = self.keys.get(key)
                if proc is None or proc.lost:
                    why = proc.lost if proc is not None else "was not made, or was dropped"
                    return done_call(error=WorkerLost(f"its {self.what} is gone: {why}"))
            else:
                try:
                    proc = self._pick()
                except OSError as e:  # no process could be started (a process limit, say)
                    return done_call(error=WorkerLost(f"no {self.what} worker could be started: {e}"))
                if proc is None:
                    return done_call(error=WorkerLost(f"no {self.what} worker can take a call: {self.size} "
                                                      "retired workers still hold calls that hung"))
            cid = next(self.ids)
            call = RemoteCall(self, proc, key, convert)
            try:
                proc.send(("call", cid, key, make, method, tuple(args), dict(kwargs or {}), tuple(attrs)))
            except (ValueError, pickle.PicklingError, TypeError, AttributeError, RecursionError) as e:
                return done_call(error=WorkerLost(f"the call could not be sent to its worker: {type(e).__name__}: {e}"))
            self.calls[cid] = call
            proc.pending.add(cid)
            if make:
                self.keys[key] = proc
                proc.keys.add(key)
            return call

    def drop(self, key) -> None:
        """The instance `key` is no longer needed (its episode ended): forgotten in its worker."""
        with self.lock:
            proc = self.keys.pop(key, None)
            if proc is None:
                return
            proc.keys.discard(key)
            if not proc.lost:
                proc.send(("drop", key))
            self._reap()

    def give_up(self, call: RemoteCall, *, hung: bool) -> None:
        """The caller gives up on `call`: at its time limit (`hung`: its worker is retired, and
        the instance it ran on is gone), or because the run stops."""
        with self.lock:
            for cid, c in list(self.calls.items()):
                if c is call:
                    del self.calls[cid]
                    call.proc.pending.discard(cid)
            if hung and not call.proc.lost:
                if call.key is not None:
                    self.keys.pop(call.key, None)
                    call.proc.keys.discard(call.key)
                self._retire(call.proc)
            self._reap()

    # --- reading answers --------------------------------------------------------------------------
    def poll(self) -> None:
        """Take in every answer that has arrived (does not wait)."""
        with self.lock:
            for proc in [*self.live, *self.retired]:
                self._drain(proc)

    def wait(self, seconds: float) -> None:
        """Wait up to `seconds` for any worker's answer, then take in what arrived."""
        with self.lock:
            conns = [p.conn for p in [*self.live, *self.retired] if p.pending and not p.lost]
        if conns:
            multiprocessing.connection.wait(conns, seconds)
        else:
            threading.Event().wait(seconds)
        self.poll()

    def _drain(self, proc: _Proc) -> None:
        while not proc.lost:
            try:
                if not proc.conn.poll(0):
                    return
                cid, ok, blob = proc.conn.recv()
            except (EOFError, OSError) as e:
                code = _exit_code(proc.process)
                self._lose(proc, f"its worker process ended ({'exit code ' + str(code) if code is not None else e})")
                return
            except Exception as e:  # noqa: BLE001 - what it sent does not unpickle: it cannot be trusted further
                self._lose(proc, f"its worker sent what cannot be read: {type(e).__name__}: {e}")
                return
            if cid is None:  # the worker has loaded the object: its calls' clocks start
                proc.loaded = time.monotonic()
                continue
            proc.pending.discard(cid)
            call = self.calls.pop(cid, None)
            if call is None:  # given up on already
                continue
            if ok:
                try:
                    call.finish(pickle.loads(blob))
                except Exception as e:  # noqa: BLE001 - an answer that does not unpickle here
                    call.finish(error=WorkerLost(f"its answer could not be read: {type(e).__name__}: {e}"))
            else:
                call.finish(error=_exception(*blob))
        self._reap()

    # --- processes --------------------------------------------------------------------------------
    def _pick(self) -> _Proc | None:
        """The least busy live worker; a new one when every live one is busy and there are fewer
        than `size` (and fewer than 2 x `size` with the retired ones)."""
        self.live = [p for p in self.live if not p.lost]
        busy = all(p.load for p in self.live)
        if busy and len(self.live) < self.size and len(self.live) + len(self.retired) < 2 * self.size:
            self.live.append(self._spawn())
        return min(self.live, key=lambda p: p.load) if self.live else None

    def _spawn(self) -> _Proc:
        """A fresh interpreter (never a fork of the trainer's threads) in a session of its own, its
        end of a socket pair as the pipe; it imports what the trainer can (the trainer's sys.path)."""
        mine, theirs = socket.socketpair()
        # JAX_PLATFORMS=cpu: the trainer holds the accelerator; user code that imports JAX gets the CPU.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path), "JAX_PLATFORMS": "cpu"}
        # Spawned from the main thread, the worker dies with the trainer even if it never reads again
        # (PR_SET_PDEATHSIG follows the spawning thread, so not from a thread that may end first).
        orphan_kill = "1" if threading.current_thread() is threading.main_thread() else "0"
        process = subprocess.Popen([sys.executable, "-c", "from grpo_jax.usercode.worker_main import main; main()",
                                    str(theirs.fileno()), orphan_kill], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env)
        theirs.close()
        conn = multiprocessing.connection.Connection(mine.detach())
        conn.send((self.name, self.kwargs, self.what, self.member))
        proc = _Proc(process, conn)
        self._all.append(proc)
        self.started += 1
        return proc

    def _retire(self, proc: _Proc) -> None:
        if proc in self.live:
            self.live.remove(proc)
            proc.retired = True
            self.retired.append(proc)
        while len(self.retired) > self.size:  # too many hung: the oldest goes, with what it held
            self._lose(self.retired[0], "its worker was killed: too many workers held calls that hung")

    def _reap(self) -> None:
        for proc in list(self.retired):
            if not proc.pending and not proc.keys:
                self._lose(proc, "its worker was retired")
        self.retired = [p for p in self.retired if not p.lost]

    def _lose(self, proc: _Proc, why: str) -> None:
        """`proc` is gone: its calls fail, its instances are lost."""
        proc.lost = why
        for cid in list(proc.pending):
            call = self.calls.pop(cid, None)
            if call is not None:
                call.finish(error=WorkerLost(why))
        proc.pending.clear()
        _kill_proc(proc)
        if proc in self._all:
            self._all.remove(proc)
        self.live = [p for p in self.live if p is not proc]
        self.retired = [p for p in self.retired if p is not proc]

    def processes(self) -> int:
        """Worker processes alive now (live and retired)."""
        with self.lock:
            return len(self._all)

    def close(self) -> None:
        """Kill every worker (their calls fail, their instances are lost)."""
        with self.lock:
            for proc in list(self._all):
                self._lose(proc, f"the {self.what} workers were closed")


def _kill_proc(proc: _Proc) -> None:
    proc.outbox.put(None)  # its writer thread ends (at once, or when the killed worker's pipe breaks)
    try:
        os.killpg(proc.process.pid, signal.SIGKILL)  # the worker and whatever it started
    except OSError:
        proc.process.kill()
    try:
        proc.process.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        pass
    proc.conn.close()


def _kill_all(procs: list[_Proc]) -> None:
    for proc in list(procs):
        _kill_proc(proc)
    procs.clear()


def _exception(pickled: bytes | None, name: str, message: str) -> BaseException:
    """A worker's exception as it was raised there, or one of the same name and message when it
    does not unpickle here (a class of a module the trainer loaded from a file path)."""
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
            if isinstance(error, Exception):  # not SystemExit & co.: they would end the trainer
                return error
        except Exception:  # noqa: BLE001
            pass
    return type(name, (RuntimeError,), {"__module__": "worker"})(message)


def _exit_code(process, wait_s: float = 1.0) -> int | None:
    """A worker's exit code once its pipe has closed (its end of the pipe closes a moment before the
    process is reaped: wait up to `wait_s`), or None if it is still running."""
    try:
        return process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None
