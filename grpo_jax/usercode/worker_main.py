"""A user-code worker process (grpo_jax.usercode.workers starts it): load the user's object, then
run each call on a thread of its own and send its answer back, until the trainer's end of the pipe
closes; then the worker's whole process group is killed."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import multiprocessing.connection
import threading

from grpo_jax.usercode.loading import load_user_object

MAX_ANSWER_BYTES = 64 << 20  # a larger answer is the call's error (it would be read on the trainer's thread)


def main() -> None:
    """The entry (`Workers._spawn`): the pipe is the descriptor in argv[1]; argv[2] "1": die with
    the trainer (PR_SET_PDEATHSIG) even when no thread here can run to read its pipe's end."""
    if sys.argv[2:3] == ["1"]:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    try:  # under memory pressure the kernel takes a worker before the trainer
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    serve(conn, *conn.recv())


def _message(payload) -> str:
    try:
        return str(payload)
    except Exception:  # noqa: BLE001 - a __str__ that raises
        return "(its message could not be printed)"


def serve(conn, name: str, kwargs: dict, what: str, member: str) -> None:
    """Load the object, then run each call on a thread of its own until the trainer's end of the
    pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides what a Ctrl-C does
    send_lock = threading.Lock()
    instances: dict = {}
    try:
        loaded, failure = load_user_object(name, what=what, member=member), None
    except BaseException as e:  # noqa: BLE001 - said on every call
        loaded, failure = None, e
    conn.send((None, True, b""))  # loaded: the calls' time limits start now

    def reply(cid, ok, payload):
        if ok:
            try:
                blob = pickle.dumps(payload)
                if len(blob) > MAX_ANSWER_BYTES:
                    raise ValueError(f"the answer is {len(blob):,} bytes, more than {MAX_ANSWER_BYTES:,}")
            except Exception as e:  # noqa: BLE001 - an answer that cannot travel is the call's error
                ok, payload = False, TypeError(f"{type(payload).__name__} cannot be sent back from the worker "
                                               f"process: {type(e).__name__}: {_message(e)[:500]}")
        if not ok:
            try:
                exc = pickle.dumps(payload)
                exc = exc if len(exc) <= MAX_ANSWER_BYTES else None
            except Exception:  # noqa: BLE001 - its name and message still travel
                exc = None
            blob = (exc, type(payload).__name__, _message(payload)[:100_000])
        with send_lock:
            conn.send((cid, ok, blob))

    def run(cid, key, make, method, args, kw, attrs):
        try:
            if failure is not None:
                raise failure
            if make:
                instances[key] = loaded(**kwargs)
            target = instances[key] if key is not None else _bound(loaded, kwargs)
            value = (getattr(target, method) if method else target)(*args, **kw)
            if attrs:
                value = (value, {a: getattr(instances[key], a, None) for a in attrs})
            reply(cid, True, value)
        except BaseException as e:  # noqa: BLE001 - the call's error, sent back
            try:
                reply(cid, False, e)
            except OSError:
                _end()

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _end()  # the trainer is gone
        if message[0] == "drop":
            instances.pop(message[1], None)
            continue
        threading.Thread(target=run, args=message[1:], daemon=True).start()


def _end() -> None:
    """The whole process group: this worker and whatever its user code started in it."""
    try:
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


def _bound(fn, kwargs: dict):
    if not kwargs:
        return fn
    return lambda *args, **fields: fn(*args, **kwargs, **fields)
