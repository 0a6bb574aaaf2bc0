"""The code sandbox and the code reward: limits hold, the process tree dies, grading resists tampering.

Short timeouts throughout: the whole file runs in a few seconds on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import textwrap
import time

import pytest

from grpo_jax.rewards import code as code_module
from grpo_jax.rewards.code import code_reward, extract_code, run_sandboxed, sandbox_isolation


ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 0) == 10"
CORRECT_ADD = "def add(a, b):\n    return a + b"


def group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def fenced(source: str) -> str:
    return f"Here is my solution.\n```python\n{textwrap.dedent(source).strip()}\n```\n"


@pytest.fixture
def shared_dir():
    """A directory the sandbox user (possibly `nobody`) can write, to observe processes from outside."""
    path = tempfile.mkdtemp(prefix="sandbox_test_")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- the sandbox -----------------------------------------------------------------------------------

def test_a_program_runs_with_stdin_in_a_fresh_directory_that_is_removed():
    r = run_sandboxed("import os\nprint(input()[::-1])\nprint(os.getcwd())", stdin="abc\n", timeout_s=5)
    assert r.status == "ok" and r.returncode == 0, r
    reversed_line, cwd = r.stdout.splitlines()
    assert reversed_line == "cba"
    assert os.path.basename(cwd).startswith("grpo_sandbox_") and not os.path.exists(cwd)


def test_the_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    r = run_sandboxed("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated)", timeout_s=5)
    names, isolated = r.stdout.splitlines()
    assert "HTTPS_PROXY" not in names and "SECRET_TOKEN" not in names and "PATH" in names
    assert isolated == "1"


def test_an_infinite_loop_is_killed_at_the_wall_clock_timeout():
    r = run_sandboxed("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout", r
    assert 0.9 <= r.wall_s < 5.0
    assert group_is_gone(r.pid)


def test_cpu_time_is_limited_per_process():
    r = run_sandboxed("while True:\n    pass", timeout_s=10.0, cpu_s=1)
    assert r.status == "killed" and r.returncode in (-24, -9), r  # SIGXCPU, or SIGKILL at the hard limit
    assert r.wall_s < 9.0  # the CPU limit, not the wall clock (slack for a loaded machine)


@pytest.mark.parametrize("bomb", [
    "x = bytearray(2 * 1024 ** 3)",                                 # one big allocation
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))",  # growth
])
def test_a_memory_bomb_hits_the_address_space_limit(bomb):
    r = run_sandboxed(bomb, timeout_s=5.0, memory_mb=256)
    assert r.status in ("error", "killed"), r
    assert r.status == "killed" or "MemoryError" in r.stderr
    assert r.wall_s < 5.0


def test_a_fork_bomb_is_capped_and_killed_with_its_group():
    source = textwrap.dedent("""
        import os, time
        forked = 0
        for _ in range(1000):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                forked += 1
            except OSError:
                break
        print(forked, flush=True)
        time.sleep(60)
    """)
    r = run_sandboxed(source, timeout_s=1.0, max_procs=8)
    assert r.status == "timeout" and r.wall_s < 5.0, r
    if "nproc" in r.isolation:
        assert int(r.stdout) < 8
    else:  # no process limit without a user namespace or uid of its own: the loop ran to its end
        assert int(r.stdout) == 1000
    assert group_is_gone(r.pid)


def test_a_child_that_outlives_the_program_is_killed(shared_dir):
    """A plain child dies with the process group; one that escaped the group with setsid dies with
    the PID namespace, where there is one."""
    beats = {name: os.path.join(shared_dir, name) for name in ("plain", "escaped")}
    source = textwrap.dedent(f"""
        import os, time
        for name, path in {beats!r}.items():
            if os.fork() == 0:
                if name == "escaped":
                    os.setsid()
                while True:
                    with open(path, "a") as f:
                        f.write(".")
                    time.sleep(0.02)
        deadline = time.monotonic() + 3
        while not all(os.path.exists(p) for p in {list(beats.values())!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("parent done")
    """)
    r = run_sandboxed(source, timeout_s=5.0)
    assert r.status == "ok" and r.stdout == "parent done\n", r
    assert group_is_gone(r.pid)
    sizes = {name: os.path.getsize(path) for name, path in beats.items()}
    assert all(size > 0 for size in sizes.values())  # they did run
    time.sleep(0.3)
    assert os.path.getsize(beats["plain"]) == sizes["plain"]
    if "pidns" in r.isolation:
        assert os.path.getsize(beats["escaped"]) == sizes["escaped"]


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_an_output_flood_is_capped(stream):
    r = run_sandboxed(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000)", timeout_s=5.0,
                      max_output_bytes=10_000)
    assert r.status == "killed" and r.wall_s < 5.0, r
    assert len(getattr(r, stream)) == 10_000 and getattr(r, f"{stream}_truncated")


def test_a_large_file_is_stopped():
    r = run_sandboxed("with open('big', 'wb') as f:\n    f.write(b'x' * (3 << 20))", timeout_s=5.0, max_file_mb=1)
    assert r.status in ("killed", "error") and r.returncode != 0, r  # SIGXFSZ, or OSError(EFBIG)


def test_the_network_is_unreachable():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # reachable from outside
        source = textwrap.dedent(f"""
            import socket, _socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1)
                print("socket: connected")
            except OSError as e:
                print("socket: blocked", e)
            raw = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            raw.settimeout(1)
            try:
                raw.connect(("127.0.0.1", {port}))
                print("raw: connected")
            except OSError as e:
                print("raw: blocked", e)
        """)
        r = run_sandboxed(source, timeout_s=5.0)
    finally:
        server.close()
    assert r.status == "ok", r
    lines = r.stdout.splitlines()
    assert lines[0].startswith("socket: blocked")  # the socket guard, everywhere
    if "netns" in r.isolation:  # the raw socket gets past the guard; only a network namespace stops it
        assert lines[1].startswith("raw: blocked"), lines


def test_processes_outside_the_sandbox_are_invisible_with_its_own_proc():
    r = run_sandboxed(f"import os\nprint(os.path.exists('/proc/{os.getpid()}'))", timeout_s=5.0)
    assert r.status == "ok", r
    assert r.stdout.strip() == str("mountns" not in r.isolation)  # this test's own process


def test_files_of_the_invoking_user_are_protected_when_running_as_root(tmp_path):
    """As root, the program runs as another uid and cannot write this user's files; without root it
    runs as this user (documented: no filesystem isolation then)."""
    target = tmp_path / "checkout_file"
    target.write_text("original")
    target.chmod(0o666)  # even a world-writable file: its directories are not reachable, or not writable
    source = f"try:\n    open({str(target)!r}, 'w').write('changed')\n    print('wrote')\nexcept OSError:\n    print('denied')"
    r = run_sandboxed(source, timeout_s=5.0)
    dropped = any(m.startswith("uid=") for m in r.isolation)
    assert r.stdout.strip() == ("denied" if dropped else "wrote"), r
    assert target.read_text() == ("original" if dropped else "changed")


def test_an_exit_status_and_a_crash_are_errors():
    assert run_sandboxed("import sys\nsys.exit(3)", timeout_s=5).returncode == 3
    r = run_sandboxed("def f():\n    raise ValueError('boom')\nf()", timeout_s=5)
    assert r.status == "error" and "ValueError: boom" in r.stderr and 'File "solution.py", line 3' in r.stderr
    assert run_sandboxed("def (:", timeout_s=5).status == "error"


def test_a_spawn_failure_is_an_infrastructure_error(monkeypatch):
    sandbox_isolation()  # probe first, so only the real run meets the broken Popen

    def broken_popen(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(code_module.subprocess, "Popen", broken_popen)
    r = run_sandboxed("print(1)", timeout_s=5)
    assert r.status == "infra_error" and "Too many open files" in r.detail
    assert code_reward(["q"], [fenced("def add(a, b):\n    return a + b")], tests=["assert add(1, 2) == 3"]) == [None]


def test_a_temp_dir_failure_is_an_infrastructure_error(monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(code_module.tempfile, "mkdtemp", no_space)
    assert run_sandboxed("print(1)", timeout_s=5).status == "infra_error"
    assert code_reward(["q"], [fenced("print(1)")], tests=[[{"input": "", "output": "1"}]]) == [None]


def test_a_sandbox_that_cannot_start_is_an_infrastructure_error():
    """The interpreter is missing: no program ran, so this is not the program's failure."""
    r = run_sandboxed("print(1)", timeout_s=5, python="/nonexistent/python3")
    assert r.status == "infra_error" and "/nonexistent/python3" in r.detail


def test_bad_limits_fail_early():
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        run_sandboxed("pass", timeout_s=0)
    with pytest.raises(ValueError, match="max_procs must be >= 2"):
        run_sandboxed("pass", max_procs=1)


def test_without_namespaces_the_sandbox_still_limits_kills_and_grades(monkeypatch):
    """Where unprivileged user namespaces are unavailable (some CI hosts), the same code runs with
    rlimits, the process group and the socket guard only."""
    monkeypatch.setattr(code_module, "_find_unshare", lambda: None)
    monkeypatch.setattr(code_module, "_launchers", {})
    isolation = sandbox_isolation()
    assert "netns" not in isolation and "session" in isolation and "rlimits" in isolation
    r = run_sandboxed("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and r.wall_s < 5.0 and group_is_gone(r.pid), r
    r = run_sandboxed("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
                      "except OSError as e:\n    print(e)", timeout_s=5.0)
    assert r.stdout.strip() == "[Errno 101] network access is disabled in the sandbox", r
    exits = "def add(a, b):\n    return 0\nimport sys\nsys.exit(0)"
    assert code_reward(["q"] * 2, [fenced(CORRECT_ADD), fenced(exits)], tests=[ADD_TESTS] * 2) == [1.0, 0.0]


# --- the code reward --------------------------------------------------------------------------------


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
    assert dict(zip(programs, scores)) == {"correct": 1.0, "trailing spaces": 1.0, "prefix only": 0.0,
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

