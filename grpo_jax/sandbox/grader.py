"""The grader and its pipe to the candidate: general tests run in a trusted process of their own.

With tests, the harness forks the grader before any candidate code exists, then the candidate's
process. Only the grader reads the tests, the value tests' expressions and the nonce (on a
descriptor the candidate's process never has). It runs each test statement in its own interpreter,
where no candidate code ever ran and the candidate's names are stand-ins (`Remote`) that call over
a pipe pair; the candidate's process runs its code, then answers (`serve`) until the grader hangs
up. What comes back is plain data rebuilt here with exact types (bool, int, float, str, bytes,
None and lists, tuples, sets, frozensets, dicts of them), or a handle (`Remote`) to a candidate's
object, usable through its attributes and methods only: comparing it (`==` too), its truth value,
hashing it or using it as a number or sequence raise TypeError. So asserts (`5 == add(2, 3)`,
`math.isclose(...)`, messages, `check(candidate)`) run on values, modules and builtins the
candidate cannot reach: its process shares no memory with the grader's and cannot read or trace
it (neither is dumpable). So that ordinary tests work: the tests' callables given as arguments
are called back; lists, dicts and sets given as arguments are copied back after the call; an
exception of a type in VALUE_ERRORS is raised as itself, any other as CandidateError (a
StopIteration could end a test's loop early); standard-library modules the tests use as
`name.attr` are the grader's own, whatever the candidate bound to the name (`stdlib_modules`).
What stays trusted: `grpo_jax.rewards.code`. Messages are length-prefixed JSON, values [tag, payload].
Standard library only: the harness loads this file by path inside the sandbox.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import sys
import types

MAX_MESSAGE_BYTES = 1 << 26  # one message from the candidate; a larger one fails the call
_MAX_DEPTH = 100
_EXACT_INT = 1 << 53  # larger integers travel in hex, which has no digit limit
_SEQUENCE_TAGS = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_SEQUENCE_TYPES = {tag: t for t, tag in _SEQUENCE_TAGS.items()}
_FROM_TEXT = {"x": lambda text: int(text, 16), "f": float, "y": lambda text: text.encode("latin-1")}
_HANDSHAKE_ITEMS = 10_000  # module-level values holding more items are passed as handles, not copied
VALUE_ERRORS = ("ArithmeticError", "AssertionError", "AttributeError", "IndexError", "KeyError", "LookupError",
                "NotImplementedError", "OverflowError", "RecursionError", "RuntimeError", "TypeError",
                "UnicodeError", "ValueError", "ZeroDivisionError")


class CandidateError(Exception):
    """An exception of the candidate's that the tests see only by its name and message."""


class ChannelError(Exception):
    """The pipe broke: the other end went away, or sent a message that is not one."""


def encode(value, ref=None, depth: int = 0):
    """`value` as JSON-ready [tag, payload]: exact plain types only, anything else `ref(value)` (a
    handle or callback) or, without `ref`, a TypeError. Floats travel as their repr (nan, inf)."""
    t = type(value)
    if value is None:
        return ["n", 0]
    if t is bool or t is str:
        return ["b" if t is bool else "s", value]
    if t is int:
        return ["i", value] if -_EXACT_INT < value < _EXACT_INT else ["x", hex(value)]
    if t is float:
        return ["f", repr(value)]
    if t is bytes:
        return ["y", value.decode("latin-1")]
    if (t in _SEQUENCE_TAGS or t is dict) and depth >= _MAX_DEPTH:
        raise TypeError(f"the value is nested more than {_MAX_DEPTH} levels deep")
    if t in _SEQUENCE_TAGS:
        return [_SEQUENCE_TAGS[t], [encode(v, ref, depth + 1) for v in value]]
    if t is dict:
        return ["d", [[encode(k, ref, depth + 1), encode(v, ref, depth + 1)] for k, v in dict.items(value)]]
    if ref is None:
        raise TypeError(f"a {t.__module__}.{t.__qualname__} is not plain data (int, float, str, list, dict, ...)")
    return ref(value)


def decode(item, resolve=None, depth: int = 0):
    """The value `encode` made, built here from JSON data of exact types; other tags go to
    `resolve(tag, payload)` (handles, callbacks), or are a ValueError without it."""
    if type(item) is not list or len(item) != 2 or type(item[0]) is not str or depth > _MAX_DEPTH:
        raise ValueError("not an encoded value")
    tag, payload = item
    kind = type(payload)
    if tag == "n" and kind is int and payload == 0:
        return None
    if (tag == "b" and kind is bool) or (tag == "i" and kind is int) or (tag == "s" and kind is str):
        return payload
    if tag in _FROM_TEXT and kind is str:
        return _FROM_TEXT[tag](payload)
    if tag in _SEQUENCE_TYPES and kind is list:
        return _SEQUENCE_TYPES[tag]([decode(v, resolve, depth + 1) for v in payload])
    if tag == "d" and kind is list:
        if not all(type(pair) is list and len(pair) == 2 for pair in payload):
            raise ValueError("not an encoded dict")
        return {decode(k, resolve, depth + 1): decode(v, resolve, depth + 1) for k, v in payload}
    if resolve is None:
        raise ValueError(f"not a plain value: tag {tag!r}")
    return resolve(tag, payload)


class Channel:
    """One end of the pipe pair: length-prefixed JSON messages. `request` sends one and, until its
    reply (["ok", ...] or ["raise", name, text]) comes, answers the other end's requests with
    `serve`, so a callback may call back."""

    def __init__(self, read_fd: int, write_fd: int, serve=None, max_bytes: int = MAX_MESSAGE_BYTES):
        self.read_fd, self.write_fd, self.serve, self.max_bytes = read_fd, write_fd, serve, max_bytes
        self.broken = ""

    def send(self, message) -> None:
        data = json.dumps(message).encode()
        view = memoryview(len(data).to_bytes(8, "big") + data)
        while view:
            view = view[os.write(self.write_fd, view):]

    def _read(self, n: int, at_boundary: bool = False) -> bytes | None:
        """`n` bytes; None at end of file before the first of them when `at_boundary`."""
        chunks, left = [], n
        while left:
            chunk = os.read(self.read_fd, min(left, 1 << 20))
            if not chunk:
                if at_boundary and left == n:
                    return None
                raise ChannelError("the other end closed the pipe in the middle of a message")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def recv(self):
        """The next message, or None at end of file (between messages)."""
        header = self._read(8, at_boundary=True)
        if header is None:
            return None
        size = int.from_bytes(header, "big")
        if size > self.max_bytes:
            raise ChannelError(f"a message of {size} bytes (at most {self.max_bytes})")
        try:
            return json.loads(self._read(size))
        except (ValueError, RecursionError) as e:
            raise ChannelError(f"not a message: {type(e).__name__}") from None

    def request(self, message):
        if self.broken:
            raise ChannelError(self.broken)
        try:
            self.send(message)
            while True:
                incoming = self.recv()
                if incoming is None:
                    raise ChannelError("the candidate's process has gone")
                if type(incoming) is list and incoming and incoming[0] in ("ok", "raise"):
                    return incoming
                self.send(self.serve(incoming))
        except (ChannelError, OSError, ValueError, TypeError, RecursionError, MemoryError) as e:
            self.broken = self.broken or f"{type(e).__name__}: {e}"
            raise ChannelError(self.broken) from None


def _refuse(self, *args):
    raise TypeError(f"{self!r} is not plain data: only its attributes and methods can be used")


class Remote:
    """In the grader, one of the candidate's objects (a function, a class, an instance): calling
    it, reading or setting an attribute go over the pipe; anything else raises TypeError."""

    __slots__ = ("_grader_id", "_grader_link")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __delattr__ = _refuse
    __hash__ = None

    def __init__(self, link: Link, oid: int):
        object.__setattr__(self, "_grader_link", link)
        object.__setattr__(self, "_grader_id", oid)

    def __call__(self, *args, **kwargs):
        return self._grader_link.call(self._grader_id, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # protocol probes stay here
            raise AttributeError(name)
        return self._grader_link.request(["getattr", self._grader_id, name])[0]

    def __setattr__(self, name: str, value) -> None:
        self._grader_link.request(["setattr", self._grader_id, name, self._grader_link.encode(value)])

    def __repr__(self) -> str:
        return f"<the candidate's object #{self._grader_id}>"


def _write_back(originals, updated) -> None:
    """The candidate's changes to the lists, dicts and sets the tests passed, copied into them."""
    for original, new in zip(originals, updated):
        if type(original) is type(new) and type(original) is list:
            original[:] = new
        elif type(original) is type(new) and type(original) in (dict, set):
            original.clear()
            original.update(new)


class Link:
    """The grader's end: requests to the candidate's process, the values of its replies rebuilt here,
    and the tests' callables it may call back (nothing else of the grader is reachable from it)."""

    def __init__(self, read_fd: int, write_fd: int):
        self.channel = Channel(read_fd, write_fd, self._serve)
        self.callbacks: list = []
        self._callback_ids: dict = {}

    def names(self) -> dict:
        """The candidate's public names, from its first message; ChannelError if there is none."""
        message = self.channel.recv()
        if not (type(message) is list and len(message) == 2 and message[0] == "names" and type(message[1]) is list):
            raise ChannelError("the candidate's process sent no names (it failed, exited or was killed)")
        names = {}
        for entry in message[1]:
            if type(entry) is list and len(entry) == 2 and type(entry[0]) is str and entry[0].isidentifier():
                try:
                    names[entry[0]] = decode(entry[1], self._resolve)
                except (ValueError, TypeError, RecursionError, MemoryError):
                    continue
        return names

    def _ref(self, value, callbacks: bool = True):
        if type(value) is Remote and value._grader_link is self:
            return ["h", value._grader_id]
        if not (callbacks and callable(value)):  # a callback's result is data: no new callable to reach
            raise TypeError(f"a test's {type(value).__qualname__} cannot be passed to the candidate: not plain data")
        if id(value) not in self._callback_ids:
            self._callback_ids[id(value)] = len(self.callbacks)
            self.callbacks.append(value)  # kept alive: its id is not reused
        return ["c", self._callback_ids[id(value)]]

    def encode(self, value):
        return encode(value, self._ref)

    def _resolve(self, tag: str, payload):
        if tag == "h" and type(payload) is int and payload >= 0:
            return Remote(self, payload)
        if tag == "c" and type(payload) is int and 0 <= payload < len(self.callbacks):
            return self.callbacks[payload]
        raise ValueError(f"not a value from the candidate: tag {tag!r}")

    def request(self, message) -> list:
        """The decoded parts of the reply to `message`; the candidate's exception raised here."""
        reply = self.channel.request(message)
        if reply[0] == "raise":
            name, text = (str(part)[:500] for part in (reply[1:] + ["", ""])[:2])
            if name in VALUE_ERRORS:
                raise getattr(builtins, name)(text)
            raise CandidateError(f"{name}: {text}")
        try:
            return [decode(part, self._resolve) for part in reply[1:]]
        except (ValueError, TypeError, RecursionError, MemoryError) as e:
            raise TypeError(f"the candidate's reply is not plain data: {e}") from None

    def call(self, oid: int, args: tuple, kwargs: dict):
        value, new_args, new_kwargs = (self.request(["call", oid, self.encode(list(args)), self.encode(kwargs)])
                                       + [None, None, None])[:3]
        if type(new_args) is list and type(new_kwargs) is dict:
            _write_back(args, new_args)
            shared = [k for k in kwargs if k in new_kwargs]
            _write_back([kwargs[k] for k in shared], [new_kwargs[k] for k in shared])
        return value

    def _serve(self, message) -> list:
        """The candidate calling back one of the tests' callables, with plain arguments."""
        try:
            if not (type(message) is list and len(message) == 4 and message[0] == "call"):
                raise TypeError("the candidate can only call back the tests' functions")
            target = self._resolve("c", message[1])
            args, kwargs = decode(message[2], self._resolve), decode(message[3], self._resolve)
            if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
                raise TypeError("malformed call")
            return ["ok", encode(target(*args, **kwargs), lambda v: self._ref(v, callbacks=False))]
        except Exception as e:  # noqa: BLE001 - reported to the caller, the candidate
            return ["raise", type(e).__name__, str(e)[:500]]

    def close(self) -> None:
        os.close(self.channel.write_fd)  # the candidate's process sees the end of file and exits


def stdlib_modules(source: str) -> dict:
    """The standard-library modules that `source` uses as `name.attr`, imported here: in the tests
    these names are the grader's own modules, whatever the candidate bound to them."""
    known = set(getattr(sys, "stdlib_module_names", ()))
    used = {node.value.id for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in known}
    modules = {}
    for name in sorted(used):
        try:
            modules[name] = importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - not importable here: the tests see no such name
            continue
    return modules


def run_calls(calls: list, namespace: dict) -> list:
    """Each value test's expression evaluated in the tests' namespace -> [["ok", encoded value] or
    ["error", exception name]]: only plain values pass; the comparison happens outside the sandbox."""
    results = []
    for call in calls:
        try:
            results.append(["ok", encode(eval(compile(call, "tests.py", "eval"), namespace))])
        except BaseException as e:  # noqa: BLE001 - the value test failed
            results.append(["error", type(e).__name__])
    return results


def write_report(fd: int, nonce: str, passed: int, total: int, values: list) -> None:
    """The grader's report, on the status pipe (which the candidate's process never has)."""
    report = memoryview(f"R {nonce} {passed} {total} {json.dumps(values)}\n".encode())
    while report:
        report = report[os.write(fd, report):]


def _small(value, budget: int = _HANDSHAKE_ITEMS) -> bool:
    """Whether `value`'s containers hold at most `budget` items in all (counted no further)."""
    stack = [value]
    while stack and budget >= 0:
        item = stack.pop()
        if type(item) in _SEQUENCE_TAGS or type(item) is dict:
            budget -= len(item)
            if budget >= 0:
                stack.extend(dict.values(item) if type(item) is dict else item)
    return budget >= 0


class CandidateEnd:
    """The candidate's end of the pipe: its objects by handle, the tests' callbacks as functions.
    It runs in the candidate's process, so it guards nothing: the grader trusts none of it."""

    def __init__(self, read_fd: int, write_fd: int):
        self.channel = Channel(read_fd, write_fd, self.serve)
        self.objects: list = []
        self._handles: dict = {}
        self._callbacks: dict = {}

    def _ref(self, value):
        if id(value) in self._callbacks and self._callbacks[id(value)][0] is value:
            return ["c", self._callbacks[id(value)][1]]
        if id(value) not in self._handles:
            self._handles[id(value)] = len(self.objects)
            self.objects.append(value)
        return ["h", self._handles[id(value)]]

    def _callback(self, cid: int):
        def callback(*args, **kwargs):
            reply = self.channel.request(["call", cid, encode(list(args), self._ref), encode(kwargs, self._ref)])
            if reply[0] == "ok":
                return decode(reply[1], self._resolve)
            error = getattr(builtins, str(reply[1]), None)
            raise (error if isinstance(error, type) and issubclass(error, Exception) else RuntimeError)(reply[2])
        self._callbacks[id(callback)] = (callback, cid)
        return callback

    def _resolve(self, tag: str, payload):
        if tag == "h":
            return self.objects[payload]
        return self._callback(payload)

    def describe(self, namespace: dict) -> list:
        """[name, encoded value] for each public name: small plain values copied, the rest by handle."""
        names = []
        for name, value in list(namespace.items()):
            if type(name) is str and not name.startswith("__") and not isinstance(value, types.ModuleType):
                try:
                    names.append([name, encode(value, self._ref) if _small(value) else self._ref(value)])
                except (TypeError, ValueError, RecursionError):
                    names.append([name, self._ref(value)])
        return names

    def serve(self, message) -> list:
        try:
            kind, oid = message[0], message[1]
            if kind == "call":
                args, kwargs = decode(message[2], self._resolve), decode(message[3], self._resolve)
                result = self.objects[oid](*args, **kwargs)
                return ["ok", encode(result, self._ref), encode(args, self._ref), encode(kwargs, self._ref)]
            if kind == "getattr":
                return ["ok", encode(getattr(self.objects[oid], message[2]), self._ref)]
            if kind == "setattr":
                setattr(self.objects[oid], message[2], decode(message[3], self._resolve))
                return ["ok", ["n", 0]]
            raise ValueError(f"unknown request {kind!r}")
        except BaseException as e:  # noqa: BLE001 - SystemExit too: reported to the grader as a failure
            return ["raise", type(e).__name__, str(e)[:500]]


def serve(namespace: dict, read_fd: int, write_fd: int) -> None:
    """In the candidate's process, after its code ran: send the grader its public names, then
    answer the grader's requests until it hangs up."""
    end = CandidateEnd(read_fd, write_fd)
    end.channel.send(["names", end.describe(namespace)])
    while (message := end.channel.recv()) is not None:
        end.channel.send(end.serve(message))
