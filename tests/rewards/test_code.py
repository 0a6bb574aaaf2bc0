"""The code reward: correct code scores, grading resists tampering, malformed tests are dropped.

Runs real sandboxes with short timeouts (the process sandbox itself: test_sandbox.py).
"""

from __future__ import annotations

import textwrap

import pytest

from grpo_jax.rewards.code import code_reward, extract_code, split_tests

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



# --- general tests: the grader's process runs them, calling the candidate over a pipe ----------------

# name -> (tests, a correct solution): ordinary shapes of test that must keep scoring 1.
HONEST = {
    "a LeetCode class": ("""
        assert Solution().two_sum([2, 7, 11, 15], 9) == [0, 1]
        assert Solution().two_sum([3, 3], 6) == [0, 1]
        """, """
        class Solution:
            def two_sum(self, nums, target):
                seen = {}
                for i, x in enumerate(nums):
                    if target - x in seen:
                        return [seen[target - x], i]
                    seen[x] = i
        """),
    "an object's state": ("""
        s = Stack()
        s.push(1)
        s.push(2)
        assert s.pop() == 2
        assert s.size() == 1
        assert s.items == [1]
        """, """
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
            def pop(self):
                return self.items.pop()
            def size(self):
                return len(self.items)
        """),
    "an in-place sort": ("xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
                         "def sort_in_place(xs):\n    xs.sort()"),
    "a callback and a key function": ("""
        assert apply_twice(lambda x: x * 3, 2) == 18
        assert sorted_by([3, 1, 2], key=lambda v: -v) == [3, 2, 1]
        """, """
        def apply_twice(f, x):
            return f(f(x))
        def sorted_by(xs, key):
            return sorted(xs, key=key)
        """),
    "an expected exception in check()": ("""
        def check(candidate):
            assert candidate(4, 2) == 2
            try:
                candidate(1, 0)
            except ValueError:
                pass
            else:
                assert False
        check(safe_div)
        """, """
        def safe_div(a, b):
            if b == 0:
                raise ValueError("b is 0")
            return a // b
        """),
    "a helper of the candidate's in check()": ("""
        def check(candidate):
            assert candidate(encode_shift("abc")) == "abc"
        check(decode_shift)
        """, """
        def encode_shift(s):
            return "".join(chr(ord(c) + 1) for c in s)
        def decode_shift(s):
            return "".join(chr(ord(c) - 1) for c in s)
        """),
    "plain types of every kind": ("""
        assert stats([1, 2, 3]) == (1, 3, 2.0)
        assert uniq([1, 1, 2]) == {1, 2}
        assert big() == 2 ** 100
        assert math.isnan(nan())
        assert counts("aab") == {"a": 2, "b": 1}
        assert raw() == b"\\x00"
        assert nothing() is None
        assert LIMIT > 5
        """, """
        import math
        LIMIT = 10
        def stats(xs):
            return min(xs), max(xs), sum(xs) / len(xs)
        def uniq(xs):
            return set(xs)
        def big():
            return 2 ** 100
        def nan():
            return math.nan
        def counts(s):
            return {c: s.count(c) for c in sorted(set(s))}
        def raw():
            return b"\\x00"
        def nothing():
            return None
        """),
}
# Shapes that cannot be graded without trusting the candidate's objects: 0 even for correct code.
UNGRADABLE = {
    "comparing two of the candidate's objects": ("assert Point(1, 2) == Point(1, 2)", """
        class Point:
            def __init__(self, x, y):
                self.x, self.y = x, y
            def __eq__(self, other):
                return (self.x, self.y) == (other.x, other.y)
        """),
    "a Counter for a dict": ("assert counts('aab') == {'a': 2, 'b': 1}",
                             "from collections import Counter\ndef counts(s):\n    return Counter(s)"),
    "a returned generator": ("assert list(evens(5)) == [0, 2, 4]",
                             "def evens(n):\n    return (i for i in range(n) if i % 2 == 0)"),
}


def test_correct_code_passes_general_tests_and_objects_are_not_values():
    cases = {**HONEST, **UNGRADABLE}
    rewards = code_reward(["q"] * len(cases), [fenced(code) for _, code in cases.values()],
                          tests=[textwrap.dedent(tests).strip() for tests, _ in cases.values()], max_workers=2)
    assert dict(zip(cases, rewards)) == {**dict.fromkeys(HONEST, 1.0), **dict.fromkeys(UNGRADABLE, 0.0)}


def test_value_tests_are_the_trailing_run_with_the_literal_on_either_side():
    general, values = split_tests("import math\nassert f(1) == 2\nassert 3 == f(2), 'msg'\nassert [1] == g()")
    assert general == "import math" and values == [("f(1)", 2), ("f(2)", 3), ("g()", [1])]
    # A value test before a general one stays in place: nothing runs in another order than written.
    general, values = split_tests("assert f(1) == 2\nassert f(2) > 1\nx = 1\nassert f(x) == 2")
    assert general == "assert f(1) == 2\nassert f(2) > 1\nx = 1" and values == [("f(x)", 2)]
    assert split_tests("assert f(1) == g(2)") == ("assert f(1) == g(2)", [])


def test_one_sample_that_fails_to_grade_costs_that_sample_only(monkeypatch, caplog):
    from grpo_jax.rewards import code as code_module

    real = code_module.run_sandboxed

    def flaky(code, **kwargs):
        if "poison" in code:
            raise RuntimeError("the harness raised")
        return real(code, **kwargs)

    monkeypatch.setattr(code_module, "run_sandboxed", flaky)
    poisoned = fenced(CORRECT_ADD + "\n# poison")
    rewards = code_reward(["q"] * 3, [fenced(CORRECT_ADD), poisoned, fenced(CORRECT_ADD)], tests=[ADD_TESTS] * 3)
    assert rewards == [1.0, None, 1.0]
    assert "grading a sample failed" in caplog.text
