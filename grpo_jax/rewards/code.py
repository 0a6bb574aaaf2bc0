"""Code-execution reward: run the model's program in the sandbox and grade it against tests.

The program runs in `grpo_jax.sandbox.run_sandboxed` (a separate, limited process tree; see that
package for the isolation). A sandbox infrastructure failure (`status="infra_error"`) makes the
reward None, never 0 or 1.

Grading is guarded against the usual reward hacks. Assert-style tests run in the same process as
the candidate (they call its functions), so a trusted harness runs the candidate as module
`solution`, then each top-level test statement in a separate namespace that holds the candidate's
names and a copy of the builtins taken before the candidate ran (a candidate cannot redefine the
tests' helpers, `assert`, or shadow `sorted`), and only when the last test has run it prints a
random per-run nonce with the pass count. The reward needs that sentinel and exit status 0, so
`sys.exit(0)` or `os._exit(0)` before the tests, or printing "all tests passed", scores 0. The
nonce and the tests reach the sandbox in a file the harness deletes before the candidate runs.
What this does not stop: a candidate that deliberately reads the interpreter's memory (frames,
gc, /proc/self/mem) can find the nonce, and one that returns objects whose `__eq__` is always
True passes `assert f(x) == y`. The process limits are the security boundary; the harness only
keeps the grading honest against ordinary exploits.
"""

from __future__ import annotations

import ast
import concurrent.futures
import re
from collections.abc import Mapping, Sequence

from grpo_jax.sandbox import run_sandboxed
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


def _normalise_output(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def code_reward(prompts: Sequence[str], completions: Sequence[str], *, tests: Sequence[object],
                partial_credit: bool = False, timeout_s: float = 5.0, memory_mb: int = 1024, max_procs: int = 32,
                max_output_bytes: int = 1_000_000, max_workers: int = 2, python: str | None = None,
                **_: object) -> list[float | None]:
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
            result = run_sandboxed(code, tests=parsed, **limits)
            if result.status == "infra_error":
                return None
            expected = sum(_is_test(node) for node in ast.parse(parsed).body)
            if result.status != "ok" or result.tests_passed is None or result.tests_total != expected:
                return 0.0  # failed, exited before the sentinel, or tampered with the harness's count
            fraction = result.tests_passed / result.tests_total
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
