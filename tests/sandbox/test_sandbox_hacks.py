"""The code reward against the hacks a policy can learn: every wrong program scores 0, the
correct control scores 1, no sample reaches another's files, nothing is left behind."""

from __future__ import annotations

import os
import tempfile
import textwrap

import pytest

from grpo_jax.rewards import code_reward
from grpo_jax.sandbox import launcher, sandbox_isolation

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 0) == 10"
CORRECT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return 0"
MARKER = "grpo_hack_marker"


def fenced(code: str) -> str:
    return f"```python\n{textwrap.dedent(code).strip()}\n```"


def namespaces() -> bool:
    return {"userns", "mountns", "pidns"} <= set(sandbox_isolation())


HACKS = {
    "nonce from the harness's frames": """
        import os, sys
        def add(a, b):
            return 0
        frame = sys._getframe()
        while frame is not None:
            nonce = frame.f_locals.get("nonce")
            if isinstance(nonce, str):
                os.write(1, f"\\n{nonce} 3 3 []\\n".encode())
                os.write(1, f"\\n{nonce} 0 0 []\\n".encode())
                os._exit(0)
            frame = frame.f_back
    """,
    "an always-equal object": """
        class Anything:
            def __eq__(self, other):
                return True
            __hash__ = object.__hash__
        def add(a, b):
            return Anything()
    """,
    "an int subclass that equals everything": """
        class Five(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def add(a, b):
            return Five(5)
    """,
    "a patched AssertionError and builtins": """
        import builtins
        builtins.AssertionError = type("AssertionError", (Exception,), {})
        builtins.isinstance = lambda *a: True
        def add(a, b):
            return 0
    """,
    "a fake success line and sys.exit(0)": """
        print("3 passed, 0 failed\\nall tests passed")
        def add(a, b):
            return 0
        import sys
        sys.exit(0)
    """,
    "killing the harness": """
        import os, signal
        def add(a, b):
            return 0
        os.kill(os.getppid(), signal.SIGKILL)
    """,
}


def test_every_hack_scores_0_and_the_correct_control_1():
    names = list(HACKS)
    rewards = code_reward(["q"] * (len(names) + 1), [fenced(HACKS[n]) for n in names] + [fenced(CORRECT)],
                          tests=[ADD_TESTS] * (len(names) + 1), max_workers=2, timeout_s=10)
    assert dict(zip([*names, "correct"], rewards)) == {**dict.fromkeys(names, 0.0), "correct": 1.0}


def test_killing_the_harness_without_namespaces_scores_0_not_none(monkeypatch):
    # Without a PID namespace the harness is an ordinary parent the program can kill.
    monkeypatch.setattr(launcher, "_find_unshare", lambda: None)
    monkeypatch.setattr(launcher, "_launchers", {})
    assert "pidns" not in sandbox_isolation()
    rewards = code_reward(["q"] * 2, [fenced(HACKS["killing the harness"]), fenced(CORRECT)],
                          tests=[ADD_TESTS] * 2, allow_weak_isolation=True)
    assert rewards == [0.0, 1.0]


# --- general tests: run by the grader's process, which no candidate code can reach ------------------

ANYTHING = """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __gt__(self, other):
        return True
    __lt__ = __le__ = __ge__ = __gt__
    def __bool__(self):
        return True
    def __float__(self):
        return 3.14159
    __hash__ = object.__hash__
"""
# Finds "secret() == <n>" in the program's own memory and in every descriptor it can read in /proc.
SCANNER = r"""
import os, re
PATTERN = re.compile(rb"secret\(\) == (\d+)")
def scan():
    found = []
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    with open("/proc/self/mem", "rb", 0) as mem:
        for fields in regions:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if fields[1].startswith("r") and end - start < 1 << 28:
                try:
                    mem.seek(start)
                    found += PATTERN.findall(mem.read(end - start))
                except (OSError, ValueError, OverflowError):
                    pass
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if int(pid) == os.getpid():  # its own: read in place (reopening may be refused)
                    found += PATTERN.findall(os.pread(int(fd), 1 << 20, 0))
                else:
                    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
                        found += PATTERN.findall(f.read(1 << 20))
            except OSError:
                pass
    return [int(n) for n in found]
"""
ALWAYS_EQUAL_ADD = ANYTHING + "def add(a, b):\n    return Anything()"
CIRCLE = "import math\ndef area(r):\n    return math.pi * r * r"
ISCLOSE = ("assert math.isclose(area(1.0), 3.14159, rel_tol=1e-3)\n"
           "assert math.isclose(area(2.0), 12.56637, rel_tol=1e-3)")
CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n\ncheck(add)"
# The last statement is not a value test, so the grader runs every one of these asserts.
MIXED = "assert 5 == add(2, 3)\nassert add(2, 3) == 5, 'add(2, 3) is 5'\nassert add(2, 3) > 4"
# name -> (tests, a wrong program that passes them in the candidate's own process, the correct one)
GENERAL_HACKS = {
    "an always-equal object: literal first, a message, >": (MIXED, ALWAYS_EQUAL_ADD, CORRECT),
    "an always-equal object, value tests with the literal first": (
        "assert 5 == add(2, 3)\nassert 0 == add(-1, 1), 'a message'", ALWAYS_EQUAL_ADD,
        CORRECT),
    "an int subclass equal to and above everything": (MIXED, """
class Five(int):
    def __eq__(self, other):
        return True
    def __gt__(self, other):
        return True
    __hash__ = int.__hash__
def add(a, b):
    return Five(0)
""", CORRECT),
    "an always-equal object inside check(candidate)": (CHECK, ALWAYS_EQUAL_ADD, CORRECT),
    "a truth value that flips": ("assert is_even(4)\nassert not is_even(3)", """
class Flip:
    state = False
    def __bool__(self):
        Flip.state = not Flip.state
        return Flip.state
def is_even(n):
    return Flip()
""", "def is_even(n):\n    return n % 2 == 0"),
    "math.isclose patched, MBPP-style (the tests use the solution's math)": (
        ISCLOSE, "import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 0.0", CIRCLE),
    "math.isclose patched, the tests import math": (
        "import math\n" + ISCLOSE, "import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 0.0",
        CIRCLE),
    "a math of the candidate's own": (ISCLOSE, """
class FakeMath:
    def isclose(self, *args, **kwargs):
        return True
math = FakeMath()
def area(r):
    return 0.0
""", CIRCLE),
    "the harness's run_statements given another __code__": (CHECK, """
import __main__
def fake(tests, namespace, *args, **kwargs):
    return sum(test for _, test in tests)
__main__.run_statements.__code__ = fake.__code__
__main__.tests_namespace.__code__ = (lambda *args, **kwargs: {}).__code__
def add(a, b):
    return 0
""", CORRECT),
    "a nonce from memory, a fake report on every descriptor": (CHECK, """
import gc, os, re, sys
def add(a, b):
    return 0
nonces = {"0" * 32}
for obj in gc.get_objects():
    for value in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()):
        if isinstance(value, str) and re.fullmatch("[0-9a-f]{32}", value):
            nonces.add(value)
frame = sys._getframe()
while frame is not None:
    nonces.update(v for v in frame.f_locals.values() if isinstance(v, str) and re.fullmatch("[0-9a-f]{32}", v))
    frame = frame.f_back
for nonce in nonces:
    for fd in range(1, 64):
        try:
            os.write(fd, f"\\nR {nonce} 1 1 []\\nX 0\\n{nonce} 1 1 []\\n".encode())
        except OSError:
            pass
os._exit(0)
""", CORRECT),
    "a StopIteration that ends the tests' map() early": (
        "assert all(map(lambda case: add(case[0], case[1]) == case[2], [(2, 3, 5), (-1, 1, 0)]))",
        "def add(a, b):\n    raise StopIteration", CORRECT),
    "the expected values read from memory or descriptors": (
        "assert secret() == 424242, 'the secret'\nassert secret() > 0",
        SCANNER + "def secret():\n    found = scan()\n    return found[0] if found else 0",
        "def secret():\n    return 424242"),
}


def test_every_general_test_hack_scores_0_and_each_correct_control_1():
    runs = [(tests, hack) for tests, hack, _ in GENERAL_HACKS.values()]
    controls = list(dict.fromkeys((tests, correct) for tests, _, correct in GENERAL_HACKS.values()))
    rewards = code_reward(["q"] * (len(runs) + len(controls)), [fenced(code) for _, code in runs + controls],
                          tests=[tests for tests, _ in runs + controls], partial_credit=True, max_workers=2,
                          timeout_s=10)
    assert dict(zip(GENERAL_HACKS, rewards)) == dict.fromkeys(GENERAL_HACKS, 0.0)  # not one assert passed
    assert rewards[len(runs):] == [1.0] * len(controls)


def test_the_memory_and_descriptor_scanner_finds_what_is_there():
    """The scanner above is no straw man: what a candidate's process holds, it finds."""
    from grpo_jax.sandbox import run_sandboxed

    r = run_sandboxed(SCANNER + "planted = 'secret() ' + '== 777'\nprint(sorted(set(scan())))",
                      stdin="secret() == 888", timeout_s=10)
    assert r.status == "ok" and r.stdout.strip() == "[777, 888]", r


@pytest.mark.skipif(not namespaces(), reason="needs a PID namespace (else it would signal the host's processes)")
def test_killing_the_grader_scores_0_and_costs_no_batch_mate():
    killer = """
        import os, signal
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) not in (1, os.getpid()):
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        def add(a, b):
            return a + b
    """
    rewards = code_reward(["q"] * 3, [fenced(CORRECT), fenced(killer), fenced(CORRECT)], tests=[CHECK] * 3)
    assert rewards == [1.0, 0.0, 1.0]


def test_without_namespaces_the_grader_still_grades_and_no_file_of_it_is_left(monkeypatch):
    monkeypatch.setattr(launcher, "_find_unshare", lambda: None)
    monkeypatch.setattr(launcher, "_launchers", {})
    peek = "import os\nassert os.listdir('.') == [], os.listdir('.')\n" + CORRECT  # the cwd holds the copies
    rewards = code_reward(["q"] * 2, [fenced(ALWAYS_EQUAL_ADD), fenced(peek)], tests=[MIXED] * 2,
                          allow_weak_isolation=True)
    assert rewards == [0.0, 1.0]


def test_the_grader_is_time_limited_and_leaves_nothing():
    from grpo_jax.sandbox import run_sandboxed

    r = run_sandboxed(CORRECT, tests="assert add(1, 1) == 2\nwhile True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and r.tests_passed is None and r.wall_s < 5.0, r
    r2 = run_sandboxed(CORRECT, tests="while True:\n    pass", timeout_s=10.0, cpu_s=1)  # the grader's CPU limit
    assert r2.tests_passed is None and r2.wall_s < 8.0, r2
    for pgid in (r.pid, r2.pid):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"process group {pgid} outlived its run")


@pytest.mark.skipif(not namespaces(), reason="needs unprivileged user, mount and PID namespaces")
def test_a_sample_cannot_reach_its_siblings_files_and_nothing_persists():
    # The attacker looks for other samples' files everywhere they used to be (their directories in
    # /tmp, the config that once held code and tests) for 3 s while 11 wrong siblings start, and
    # rewrites any it finds with a correct program; it leaves markers in every temporary directory.
    attacker = f"""
        import glob, json, os, time
        def add(a, b):
            return 0
        correct = {CORRECT!r}
        found = 0
        end = time.time() + 3
        while time.time() < end:
            for path in glob.glob("/tmp/**/*", recursive=True) + glob.glob("/tmp/**/.*", recursive=True):
                if os.path.isfile(path) and "{MARKER}" not in path:
                    found += 1
                    try:
                        with open(path, "w") as f:
                            f.write(json.dumps({{"code": correct}}) if path.endswith(".json") else correct)
                    except OSError:
                        pass
            time.sleep(0.01)
        for d in ("/tmp", "/dev/shm", "/var/tmp"):
            with open(os.path.join(d, "{MARKER}"), "w") as f:
                f.write("x" * 1000)
        print("found", found)
    """
    before = {d: set(os.listdir(d)) for d in ("/tmp", "/dev/shm", "/var/tmp") if os.path.isdir(d)}
    completions = [fenced(attacker)] + [fenced(WRONG)] * 11
    rewards = code_reward(["q"] * 12, completions, tests=[ADD_TESTS] * 12, max_workers=4, timeout_s=20)
    assert rewards == [0.0] * 12
    for d, names in before.items():
        left = set(os.listdir(d)) - names
        assert not [n for n in left if MARKER in n or n.startswith("grpo_sandbox_")], (d, left)
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), MARKER))


@pytest.mark.skipif(not namespaces(), reason="needs a mount namespace")
def test_the_private_tmp_is_capped():
    from grpo_jax.sandbox import run_sandboxed

    program = textwrap.dedent("""
        import os
        written = 0
        try:
            for d in ("/tmp", "/dev/shm", "/var/tmp"):
                with open(os.path.join(d, "fill"), "wb") as f:
                    for _ in range(64):
                        f.write(b"x" * (1 << 20))
                        written += 1
        except OSError as e:
            print(e.errno, written)
    """)
    r = run_sandboxed(program, max_tmp_mb=8, max_file_mb=64, timeout_s=10)
    assert r.status == "ok", r
    errno, written = map(int, r.stdout.split())
    assert errno == 28 and written <= 8  # ENOSPC once the 8 MiB shared by the three are full


def test_a_run_logs_its_isolation_and_refuses_weak_isolation_unless_allowed(tmp_path, monkeypatch, capsys):
    import yaml
    from runs import CONFIG

    from grpo_jax import cli
    from grpo_jax.config import config_from_dict
    from grpo_jax.trainer.prepare import prepare

    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")},
              "rewards": [{"name": "math_accuracy"}, {"name": "code", "weight": 0.0}]}
    if namespaces():
        assert any(n.startswith("code sandbox isolation: ") and "WEAK" not in n
                   for n in prepare(config_from_dict(config)).notes)
    monkeypatch.setattr(launcher, "_find_unshare", lambda: None)
    monkeypatch.setattr(launcher, "_launchers", {})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["train", "--config", str(path), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "rewards[1] (code): the code sandbox has no userns, mountns, pidns here" in err, err
    assert not (tmp_path / "run").exists()
    config["rewards"][1]["kwargs"] = {"allow_weak_isolation": True}
    notes = prepare(config_from_dict(config)).notes
    assert any("WEAK: no userns, mountns, pidns; allowed by allow_weak_isolation" in n for n in notes), notes
