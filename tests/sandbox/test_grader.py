"""The grader's pipe, in-process: both ends over real pipes (the candidate's end on a thread), no
sandbox. What the grader gets back is plain data of exact types or a handle that refuses to be
compared; the tests' callables, in-place arguments and exceptions work. End to end: test_sandbox_hacks.py."""

from __future__ import annotations

import ast
import math
import os
import pathlib
import sys
import threading

import pytest

from grpo_jax.sandbox import grader


@pytest.fixture
def connect():
    """connect(namespace) -> (the grader's Link, the candidate's names as the grader sees them)."""
    links, others, threads = [], [], []

    def connect(namespace: dict):
        candidate_reads, grader_writes = os.pipe()
        grader_reads, candidate_writes = os.pipe()
        others.extend((candidate_reads, grader_reads, candidate_writes))
        thread = threading.Thread(target=grader.serve, args=(namespace, candidate_reads, candidate_writes), daemon=True)
        threads.append(thread)
        thread.start()
        links.append(grader.Link(grader_reads, grader_writes))
        return links[-1], links[-1].names()

    yield connect
    for link in links:
        link.close()  # the candidate's end sees the end of file and returns
    for thread in threads:
        thread.join(timeout=5)
        assert not thread.is_alive()
    for fd in others:
        os.close(fd)


class Anything:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__

    def __gt__(self, other):
        return True

    def __bool__(self):
        return True

    def __float__(self):
        return 3.14159


class Five(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class Stack:
    def __init__(self):
        self.items = []

    def push(self, x):
        self.items.append(x)

    def pop(self):
        return self.items.pop()


PLAIN = [None, True, False, 0, -5, 2 ** 53, -(2 ** 200), 10 ** 5000, 1.5, -0.0, float("inf"), "", "héllo\ud800",
         b"\x00\xff", [1, [2, (3,)]], (), {1, "a"}, frozenset({2}), {"k": [1.0], (1, 2): None}]


def test_plain_values_come_back_as_exact_types():
    for value in PLAIN:
        back = grader.decode(grader.encode(value))
        assert back == value and type(back) is type(value), value
    assert math.isnan(grader.decode(grader.encode(float("nan"))))
    for cheat in (Five(5), Anything(), [Five(5)], {"a": Anything()}, [object()]):
        with pytest.raises(TypeError):
            grader.encode(cheat)
    with pytest.raises(ValueError):
        grader.decode(["h", 0])  # a handle without a channel: not plain data
    with pytest.raises(ValueError):
        grader.decode(["i", "5"])  # a payload of the wrong type


def test_candidate_objects_refuse_comparison_truth_and_arithmetic(connect):
    _, names = connect({"add": lambda a, b: Anything(), "five": lambda: Five(5), "plain": lambda: 5})
    assert names["plain"]() == 5 and type(names["plain"]()) is int
    for value in (names["add"](2, 3), names["five"]()):
        assert isinstance(value, grader.Remote)
        for probe in (lambda v: v == 5, lambda v: 5 == v, lambda v: v != 4, lambda v: v > 4, lambda v: 4 < v,
                      lambda v: bool(v), lambda v: not v, lambda v: math.isclose(v, 3.14159), lambda v: v in [5],
                      lambda v: hash(v), lambda v: float(v), lambda v: v + 0, lambda v: len(v), lambda v: list(v),
                      lambda v: sorted([v, v]), lambda v: abs(v - 5) < 1):
            with pytest.raises(TypeError):
                probe(value)
        assert value is not None and not isinstance(value, int)


def test_objects_work_through_attributes_and_methods(connect):
    _, names = connect({"Stack": Stack, "LIMIT": 10, "TABLE": {"a": [1, 2]}})
    assert names["LIMIT"] == 10 and names["TABLE"] == {"a": [1, 2]}
    s = names["Stack"]()
    s.push(1)
    s.push([2, 3])
    assert s.items == [1, [2, 3]] and s.pop() == [2, 3] and s.pop() == 1
    s.label = "x"
    assert s.label == "x"
    with pytest.raises(IndexError):  # the candidate's exception, as itself
        s.pop()
    with pytest.raises(AttributeError):
        s.missing  # noqa: B018
    assert getattr(s, "missing", "default") == "default"


def test_callbacks_in_place_arguments_and_exceptions(connect):
    def sort_in_place(xs, key=None):
        xs.sort(key=key)

    def stop(*_):
        raise StopIteration

    def apply(f, x):
        return f(f(x))

    def leave():
        raise SystemExit(0)

    _, names = connect({"sort_in_place": sort_in_place, "apply": apply, "stop": stop,
                        "fail": lambda: int("x"), "leave": leave})
    xs = [3, 1, 2]
    names["sort_in_place"](xs, key=lambda v: -v)
    assert xs == [3, 2, 1]
    assert names["apply"](lambda v: v * 2, 3) == 12
    with pytest.raises(ValueError):
        names["fail"]()
    with pytest.raises(grader.CandidateError, match="StopIteration"):  # not a StopIteration: it would end map()
        names["stop"]()
    with pytest.raises(grader.CandidateError):  # in the candidate's process this all() would be True
        all(map(lambda v: names["stop"](v) == v, [1, 2]))  # noqa: C417 - map() is the point
    with pytest.raises(grader.CandidateError, match="SystemExit"):
        names["leave"]()
    with pytest.raises(TypeError, match="cannot be passed"):
        names["apply"](lambda v: v, object())  # the tests' own objects stay here
    with pytest.raises(TypeError, match="cannot be passed"):  # nor can a callback hand out another callable
        names["apply"](lambda v: print, 0)


def test_a_broken_candidate_end_fails_every_later_call():
    candidate_reads, grader_writes = os.pipe()
    grader_reads, candidate_writes = os.pipe()
    try:
        link = grader.Link(grader_reads, grader_writes)
        os.write(candidate_writes, b"\xff" * 8)  # a header announcing an absurd size
        with pytest.raises(grader.ChannelError, match="bytes"):
            link.names()
        names = b'["names", [["x", ["i", 1]], ["1bad", ["i", 2]], ["y", ["h", "no"]]]]'
        os.write(candidate_writes, len(names).to_bytes(8, "big") + names)
        assert link.names() == {"x": 1}  # names that are not identifiers or values are dropped
        os.write(candidate_writes, (5).to_bytes(8, "big") + b"junk!")
        with pytest.raises(grader.ChannelError, match="not a message"):
            grader.Remote(link, 0)()
        assert os.read(candidate_reads, 1 << 16)  # the request did go out
        with pytest.raises(grader.ChannelError):  # broken for good: nothing more is sent
            grader.Remote(link, 0)()
    finally:
        for fd in (candidate_reads, grader_writes, grader_reads, candidate_writes):
            os.close(fd)


def test_stdlib_modules_the_tests_use_are_the_graders_own():
    modules = grader.stdlib_modules("assert math.isclose(area(1.0), 3.14)\nassert re.match('a', s)\nx.y\nnp.array")
    assert modules == {"math": math, "re": __import__("re")}


def test_the_grader_imports_only_the_standard_library():
    """The harness loads it by path under `python -I` in the sandbox, where grpo_jax is unreachable."""
    tree = ast.parse(pathlib.Path(grader.__file__).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
