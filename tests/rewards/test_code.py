"""The code reward: correct code scores, grading resists tampering, malformed tests are dropped.

Runs real sandboxes with short timeouts (the process sandbox itself: test_sandbox.py).
"""

from __future__ import annotations

import textwrap

import pytest

from grpo_jax.rewards.code import code_reward, extract_code

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 0) == 10"
CORRECT_ADD = "def add(a, b):\n    return a + b"


def fenced(source: str) -> str:
    return f"Here is my solution.\n```python\n{textwrap.dedent(source).strip()}\n```\n"


@pytest.mark.parametrize("source,why", [
    ("def add(a, b):\n    return a - b\nimport sys\nsys.exit(0)", "sys.exit(0) before the tests"),
    ("def add(a, b):\n    return a - b\nimport os\nos._exit(0)", "os._exit(0) before the tests"),
    ("def add(a, b):\n    return a - b\nprint('3 3')\nprint('All tests passed')\nimport os\nos._exit(0)",
     "printing a fake success line"),
    ("def add(a, b):\n    raise SystemExit(0)", "exiting from inside the tested function"),
    ("import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
     "def add(a, b):\n    return 0", "replacing AssertionError"),
    ("import builtins\nbuiltins.sum = lambda *args: 1\nbuiltins.len = lambda *args: 1\n"
     "def add(a, b):\n    return 5", "patching builtins a harness might count with (1 of 3 passes)"),
    ("def add(a, b):\n    return a - b\nwhile True:\n    pass", "a program that never returns"),
])
def test_tampering_or_escaping_the_tests_scores_zero(source, why):
    assert code_reward(["q"], [fenced(source)], tests=[ADD_TESTS], timeout_s=1.0) == [0.0], why


def test_redefining_the_test_function_scores_zero():
    tests = "def check(candidate):\n    assert candidate(2, 3) == 5\n\ncheck(add)"
    cheat = "def add(a, b):\n    return 0\n\ndef check(candidate):\n    return True"
    assert code_reward(["q"], [fenced(cheat)], tests=[tests]) == [0.0]
    assert code_reward(["q"], [fenced(CORRECT_ADD)], tests=[tests]) == [1.0]


def test_shadowing_or_patching_a_builtin_the_tests_use_scores_zero():
    tests = "assert sorted(evens(10)) == [0, 2, 4, 6, 8]"
    shadow = "def evens(n):\n    return []\n\ndef sorted(xs):\n    return [0, 2, 4, 6, 8]"
    patch = "import builtins\nbuiltins.sorted = lambda xs: [0, 2, 4, 6, 8]\n\ndef evens(n):\n    return []"
    honest = "def evens(n):\n    return [i for i in range(n) if i % 2 == 0][::-1]"
    assert code_reward(["q"] * 3, [fenced(shadow), fenced(patch), fenced(honest)], tests=[tests] * 3) == [0.0, 0.0, 1.0]


def test_the_tests_and_nonce_are_not_on_disk_for_the_candidate():
    peek = "import os\nassert os.listdir('.') == [], os.listdir('.')\n\n" + CORRECT_ADD
    assert code_reward(["q"], [fenced(peek)], tests=[ADD_TESTS]) == [1.0]


def test_correct_code_scores_one_and_partial_credit_is_a_kwarg():
    almost = "def add(a, b):\n    return a + b if a > 0 else 99"  # passes 2 of 3
    completions = [fenced(CORRECT_ADD), fenced(almost), "no code at all"]
    assert code_reward(["q"] * 3, completions, tests=[ADD_TESTS] * 3) == [1.0, 0.0, 0.0]
    scores = code_reward(["q"] * 3, completions, tests=[ADD_TESTS] * 3, partial_credit=True)
    assert scores == [1.0, pytest.approx(2 / 3), 0.0]


def test_stdin_cases_compare_the_full_output():
    cases = [{"input": "3\n1 2 3\n", "output": "1\n2\n3\n"}, {"input": "2\n5 6\n", "output": "5\n6"}]
    programs = {
        "correct": "n = int(input())\nfor x in input().split():\n    print(x)",
        "trailing spaces": "n = int(input())\nfor x in input().split():\n    print(x + '   ')",
        "prefix only": "n = int(input())\nprint(input().split()[0])",
        "extra line": "n = int(input())\nfor x in input().split():\n    print(x)\nprint('done')",
        "crash after output": "n = int(input())\nfor x in input().split():\n    print(x)\nraise SystemExit(1)",
        "exit 0 before output": "import sys\nsys.exit(0)",
    }
    scores = code_reward(["q"] * len(programs), [fenced(p) for p in programs.values()], tests=[cases] * len(programs))
    assert dict(zip(programs, scores, strict=True)) == {"correct": 1.0, "trailing spaces": 1.0, "prefix only": 0.0,
                                           "extra line": 0.0, "crash after output": 0.0,
                                           "exit 0 before output": 0.0}


def test_stdin_partial_credit_counts_cases():
    cases = [{"input": "1\n", "output": "1"}, {"input": "2\n", "output": "4"}]
    echo = "print(input())"
    assert code_reward(["q"], [fenced(echo)], tests=[cases], partial_credit=True) == [0.5]
    assert code_reward(["q"], [fenced(echo)], tests=[cases]) == [0.0]


@pytest.mark.parametrize("field", [
    42, "", "def broken(:", "import math", '"""only a docstring"""', [], [{"input": "1"}], [{"input": 1, "output": "1"}],
    {"input": "1", "output": "1"},
])
def test_a_malformed_tests_field_is_dropped(field):
    assert code_reward(["q"], [fenced(CORRECT_ADD)], tests=[field]) == [None]


def test_extract_code_takes_the_last_python_block():
    text = "```python\nfirst\n```\nthen\n```py\nsecond\n```\n```bash\nls\n```\n```python\nunclosed"
    assert extract_code(text) == "second"
    assert extract_code("```\nplain\n```") == "plain"
    assert extract_code("no fences") is None


def test_samples_keep_their_order_across_the_thread_pool():
    completions = [fenced(CORRECT_ADD), fenced("def add(a, b):\n    return 0"), "nothing"] * 2
    assert code_reward(["q"] * 6, completions, tests=[ADD_TESTS] * 6, max_workers=3) == [1.0, 0.0, 0.0] * 2
    with pytest.raises(ValueError, match="max_workers"):
        code_reward(["q"], ["x"], tests=[ADD_TESTS], max_workers=0)
    with pytest.raises(ValueError, match="lengths differ"):
        code_reward(["q"], ["x", "y"], tests=[ADD_TESTS] * 2)

