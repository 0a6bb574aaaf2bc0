"""Code-execution reward: run the model's program in the sandbox and grade it against tests.

The program runs in `grpo_jax.sandbox.run_sandboxed` (a separate, limited process tree; see that
package for the isolation). A sandbox infrastructure failure (`status="infra_error"`) makes the
reward None, never 0 or 1.

Grading is guarded against reward hacks by where each comparison happens:
- **Value tests** (`assert <expression> == <literal>`, the usual shape of function tests) are graded
  on the trusted side: only the expression (e.g. `add(2, 3)`) is sent into the sandbox, which
  returns its value as plain data (exact int/float/str/bool/None/bytes and lists, tuples, sets and
  dicts of them, `grpo_jax.sandbox.harness.encode_value`), and the comparison with the expected
  value happens here. The expected values never enter the sandbox, so reading the harness's frames,
  patching builtins, faking output or returning an always-equal object (or an int subclass) gains
  nothing: a faked result still has to be the right value.
- **General tests** (anything else: `assert is_sorted(f(x))`, `check(candidate)`) must run in the
  candidate's process. A trusted harness runs them after the candidate, each top-level statement in
  a namespace with the candidate's names and a copy of the builtins taken before it ran, and prints
  a random per-run nonce with the pass count after the last one; the reward needs that sentinel and
  exit status 0, so `sys.exit(0)` before the tests or printing "all tests passed" scores 0. What
  these trust: a candidate that reads the interpreter's memory (frames, gc) can find the nonce and
  print a fake count, and one returning an always-equal object passes `assert f(x) == g(y)`. Write
  tests as value tests where you can.
A sample that kills the harness or its own sandbox scores 0; only a failure outside the sample's
reach (the sandbox cannot start) is None. The code reward refuses to run without user, mount and
PID namespaces (a container without unprivileged namespaces, a non-root TPU VM user may lack them)
unless `allow_weak_isolation: true`: without them samples share /tmp and can see each other.
"""

from __future__ import annotations

import ast
import concurrent.futures
import re
from collections.abc import Mapping, Sequence

from grpo_jax.sandbox import run_sandboxed, sandbox_isolation
from grpo_jax.sandbox.harness import is_test as _is_test  # the harness counts tests by the same rule

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


def split_tests(source: str) -> tuple[str, list[tuple[str, object]]]:
    """(the general tests' source, [(expression, expected value)] of the value tests): a top-level
    `assert <expression> == <literal>` without a message is a value test, graded outside the
    sandbox; every other statement stays in the general tests, in order."""
    general, values = [], []
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assert) and node.msg is None and isinstance(node.test, ast.Compare)
                and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
            try:
                expected = ast.literal_eval(node.test.comparators[0])
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
            else:
                values.append((ast.unparse(node.test.left), expected))
                continue
        general.append(node)
    return ast.unparse(ast.Module(general, type_ignores=[])), values


def _same(value: object, expected: object) -> bool:
    try:
        return bool(value == expected)  # both plain data: no user-defined __eq__ is involved
    except Exception:  # noqa: BLE001 - e.g. comparing unorderable plain values: not equal
        return False


def _normalise_output(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


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
    code fails or there is no code block, None if the sandbox failed (infrastructure) or the
    example's `tests` field is malformed. Samples run in parallel on `max_workers` threads.
    """
    if len(prompts) != len(completions) or len(tests) != len(completions):
        raise ValueError(f"lengths differ: {len(prompts)} prompts, {len(completions)} completions, {len(tests)} tests")
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    check_isolation(allow_weak_isolation=allow_weak_isolation, python=python)
    limits = dict(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs, max_output_bytes=max_output_bytes,
                  python=python)

    def grade(completion: str, field: object) -> float | None:
        parsed = _parse_tests(field)
        if parsed is None:
            return None
        code = extract_code(completion)
        if code is None:
            return 0.0
        if isinstance(parsed, str):
            general, value_tests = split_tests(parsed)
            result = run_sandboxed(code, tests=general, calls=[call for call, _ in value_tests], **limits)
            if result.status == "infra_error":
                return None
            expected = sum(_is_test(node) for node in ast.parse(general).body)
            if (result.status != "ok" or result.tests_passed is None or result.tests_total != expected
                    or result.call_values is None or len(result.call_values) != len(value_tests)):
                return 0.0  # failed, exited before the sentinel, or tampered with the harness's output
            passed = result.tests_passed + sum(kind == "ok" and _same(value, want) for (kind, value), (_, want)
                                               in zip(result.call_values, value_tests))
            fraction = passed / (expected + len(value_tests))
            return fraction if partial_credit else float(fraction == 1.0)
        passed = 0
        for stdin, expected in parsed:
            result = run_sandboxed(code, stdin=stdin, **limits)
            if result.status == "infra_error":
                return None
            if result.status == "ok" and _normalise_output(result.stdout) == _normalise_output(expected):
                passed += 1
            elif not partial_credit:
                return 0.0
        return passed / len(parsed)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="code_reward") as pool:
        return list(pool.map(grade, completions, tests))
