"""Code-execution reward: run the model's program in the sandbox and grade it against tests.

The program runs in `grpo_jax.sandbox.run_sandboxed` (a separate, limited process tree; see that
package for the isolation). A sandbox infrastructure failure (`status="infra_error"`) makes the
reward None, never 0 or 1.

No comparison happens where the candidate's code runs:
- **Value tests** (a trailing run of `assert <expression> == <literal>`, or `<literal> ==
  <expression>`, with or without a message) are graded here: only the expression (e.g. `add(2,
  3)`) enters the sandbox, its value comes back as plain data (exact bool, int, float, str, bytes,
  None and lists, tuples, sets, dicts of them) and is compared here with an expected value the
  sandbox never saw.
- **Every other test** (`assert is_sorted(f(x))`, `assert math.isclose(area(1.0), 3.14159,
  rel_tol=1e-3)`, `check(candidate)`, the statements between them) runs in the sandbox's grader
  (`grpo_jax.sandbox.grader`): a process forked before any candidate code runs, the only one
  holding the tests and the nonce, which runs each statement in its own interpreter and calls the
  candidate's functions over a pipe, getting back plain values or handles to the candidate's
  objects. So patching builtins or modules (`math.isclose = ...`) or the harness
  (`__main__.run_statements.__code__ = ...`), reading frames for the nonce, an always-equal or
  always-true result, exiting early or printing a success line all score 0.
What the general tests still trust, or cannot grade, by shape:
- the candidate's objects (`Solution().two_sum(...)`, `s = Stack(); s.push(1); assert s.pop() ==
  1`) are used through their attributes and methods only, each value checked by the grader as for
  functions; comparing, hashing, iterating, `len`, `str`, arithmetic or the truth value of such an
  object raise TypeError, so a test of a class's `__eq__`, of `isinstance(x, TheirClass)` or of a
  returned generator, Counter, Fraction or numpy value fails even for correct code;
- a name the solution imported that the tests call (`from math import isclose` there, `assert
  isclose(...)` here) is the candidate's function and can be faked; a standard-library module
  the tests use as `math.isclose` is the grader's own, whatever the candidate bound to `math`; a
  module the solution imported under another name (`import numpy as np`) is not passed on;
- objects of the tests' own classes cannot be passed to the candidate (that call fails); the
  tests' functions can (the candidate calls them back);
- arguments are copies: lists, dicts and sets are copied back after the call, identity is not
  (`f(xs) is xs` is False); the candidate's module-level values are copied once, after its code
  ran; `import solution` does not work in the tests.
A sample that kills the harness, the grader or its own sandbox scores 0; only a failure outside the
sample's reach (the sandbox cannot start) is None, and so is an exception while grading one sample
(logged): it never costs the other samples of the call. The code reward refuses to run without
user, mount and PID namespaces (a container without unprivileged namespaces, a non-root TPU VM
user may lack them) unless `allow_weak_isolation: true`: without them samples share /tmp and can
see each other.
"""

from __future__ import annotations

import ast
import concurrent.futures
import functools
import logging
import re
from collections.abc import Mapping, Sequence

from grpo_jax.sandbox import run_sandboxed, sandbox_isolation
from grpo_jax.sandbox.harness import is_test as _is_test  # the harness counts tests by the same rule

log = logging.getLogger(__name__)

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[ \t]*$")
_PYTHON_LANGS = ("python", "python3", "py", "")


def extract_code(completion: str) -> str | None:
    """The last complete ```python (or ```py, or untagged) fenced block, or None. A block left
    open at the end (a truncated completion) does not count."""
    blocks, current, lang = [], None, ""
    for line in completion.splitlines():
        fence = _FENCE.match(line)
        if current is None:
            if fence:
                current, lang = [], fence.group(1).lower()
        elif fence and not fence.group(1):
            if lang in _PYTHON_LANGS:
                blocks.append("\n".join(current))
            current = None
        else:
            current.append(line)
    return blocks[-1] if blocks else None


def _parse_tests(field: object) -> str | list[tuple[str, str]] | None:
    """An example's tests as assert-style source or (input, output) cases; None when malformed."""
    if isinstance(field, str):
        try:
            body = ast.parse(field).body
        except (SyntaxError, ValueError):
            return None
        return field if any(_is_test(node) for node in body) else None
    if isinstance(field, (list, tuple)) and field:
        cases = []
        for case in field:
            if not (isinstance(case, Mapping) and isinstance(case.get("input"), str)
                    and isinstance(case.get("output"), str)):
                return None
            cases.append((case["input"], case["output"]))
        return cases
    return None


_STRONG = ("userns", "mountns", "pidns")  # what keeps samples apart: their own files, processes


def check_isolation(*, allow_weak_isolation: bool = False, python: str | None = None) -> str:
    """The sandbox's isolation here, as a line to log at start-up; a ValueError when it lacks user,
    mount or PID namespaces (samples could then see each other's files) unless allowed."""
    try:
        isolation = sandbox_isolation(python)
    except RuntimeError as e:
        raise ValueError(f"the code reward cannot start a sandbox here: {e}") from None
    missing = [m for m in _STRONG if m not in isolation]
    line = f"code sandbox isolation: {', '.join(isolation)}"
    if missing:
        if not allow_weak_isolation:
            raise ValueError(f"the code sandbox has no {', '.join(missing)} here (isolation: {', '.join(isolation)}): "
                             "samples could read and write each other's files; enable unprivileged user namespaces, "
                             "or set the code reward's kwargs allow_weak_isolation: true to accept that")
        line += f" (WEAK: no {', '.join(missing)}; allowed by allow_weak_isolation)"
    return line


def _value_test(node: ast.stmt) -> tuple[str, object] | None:
    """(expression, expected value) of `assert <expression> == <literal>` or `assert <literal> ==
    <expression>` (a message only explains a failure), else None."""
    if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return None
    sides = (node.test.left, node.test.comparators[0])
    for expression, literal in (sides, sides[::-1]):
        try:
            return ast.unparse(expression), ast.literal_eval(literal)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return None


def split_tests(source: str) -> tuple[str, list[tuple[str, object]]]:
    """(the general tests' source, [(expression, expected value)] of the value tests): the value
    tests are the trailing run of statements that are value tests (`_value_test`), graded outside
    the sandbox in the same order after the rest, so nothing runs in another order than written."""
    body = ast.parse(source).body
    split = len(body)
    while split and _value_test(body[split - 1]) is not None:
        split -= 1
    values = [_value_test(node) for node in body[split:]]
    return ast.unparse(ast.Module(body[:split], type_ignores=[])), values


def _same(value: object, expected: object) -> bool:
    try:
        return bool(value == expected)  # both plain data: no user-defined __eq__ is involved
    except Exception:  # noqa: BLE001 - e.g. comparing unorderable plain values: not equal
        return False


def _normalise_output(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _grade_asserts(code: str, source: str, partial_credit: bool, limits: dict) -> float | None:
    general, value_tests = split_tests(source)
    result = run_sandboxed(code, tests=general, calls=[call for call, _ in value_tests], **limits)
    if result.status == "infra_error":
        return None
    expected = sum(_is_test(node) for node in ast.parse(general).body)
    if (result.status != "ok" or result.tests_passed is None or result.tests_total != expected
            or result.call_values is None or len(result.call_values) != len(value_tests)):
        return 0.0  # failed, exited or was killed before the grader reported, or killed the grader
    passed = result.tests_passed + sum(kind == "ok" and _same(value, want) for (kind, value), (_, want)
                                       in zip(result.call_values, value_tests))
    fraction = passed / (expected + len(value_tests))
    return fraction if partial_credit else float(fraction == 1.0)


def _grade_stdin(code: str, cases: list[tuple[str, str]], partial_credit: bool, limits: dict) -> float | None:
    passed = 0
    for stdin, expected in cases:
        result = run_sandboxed(code, stdin=stdin, **limits)
        if result.status == "infra_error":
            return None
        if result.status == "ok" and _normalise_output(result.stdout) == _normalise_output(expected):
            passed += 1
        elif not partial_credit:
            return 0.0
    return passed / len(cases)


def _grade(completion: str, field: object, partial_credit: bool, limits: dict) -> float | None:
    """One sample's reward; None, logged, when grading it raises: never its batch-mates'."""
    try:
        parsed = _parse_tests(field)
        if parsed is None:
            return None
        code = extract_code(completion)
        if code is None:
            return 0.0
        if isinstance(parsed, str):
            return _grade_asserts(code, parsed, partial_credit, limits)
        return _grade_stdin(code, parsed, partial_credit, limits)
    except Exception:  # one sample's failure costs that sample only
        log.warning("code reward: grading a sample failed; it scores None", exc_info=True)
        return None


def code_reward(prompts: Sequence[str], completions: Sequence[str], *, tests: Sequence[object],
                partial_credit: bool = False, timeout_s: float = 5.0, memory_mb: int = 1024, max_procs: int = 32,
                max_output_bytes: int = 1_000_000, max_workers: int = 2, python: str | None = None,
                allow_weak_isolation: bool = False, **_: object) -> list[float | None]:
    """Grade the last Python code block of each completion against its example's `tests`.

    `tests` per example is either assert-style Python source that calls the candidate's functions
    (e.g. `assert add(2, 3) == 5`, or `def check(f): ...` followed by `check(add)`), or a
    non-empty list of `{"input": str, "output": str}` cases for a program that reads stdin; the
    output must match in full, after stripping trailing whitespace per line and trailing blank
    lines. 1.0 if every test passes (with `partial_credit`, the fraction that pass), 0.0 if the
    code fails or there is no code block, None if the sandbox failed (infrastructure), the
    example's `tests` field is malformed or grading the sample raised. Samples run in parallel on
    `max_workers` threads.
    """
    if len(prompts) != len(completions) or len(tests) != len(completions):
        raise ValueError(f"lengths differ: {len(prompts)} prompts, {len(completions)} completions, {len(tests)} tests")
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    check_isolation(allow_weak_isolation=allow_weak_isolation, python=python)
    limits = dict(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs, max_output_bytes=max_output_bytes,
                  python=python)
    grade = functools.partial(_grade, partial_credit=partial_credit, limits=limits)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="code_reward") as pool:
        return list(pool.map(grade, completions, tests))
