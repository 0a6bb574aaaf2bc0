"""The code sandbox: limits hold, the process tree dies, the harness runs by path and its helpers work.

Short timeouts throughout: the whole file runs in a few seconds on 2 cores. Grading: test_rewards_code.py.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from grpo_jax.rewards.code import code_reward
from grpo_jax.sandbox import harness, launcher, run_sandboxed, runner, sandbox_isolation

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


# --- the sandbox -----------------------------------------------------------------------------------

def test_a_program_runs_with_stdin_in_a_fresh_directory_that_is_removed(monkeypatch):
    # A temporary directory of this test's own: other test files' sandboxes (another xdist worker)
    # make and remove theirs in the shared one meanwhile.
    own = tempfile.mkdtemp(prefix="sandbox_test_")
    os.chmod(own, 0o711)  # the sandbox user passes through it to its own directory
    monkeypatch.setattr(tempfile, "tempdir", own)
    r = run_sandboxed("import os\nprint(input()[::-1])\nprint(os.getcwd())", stdin="abc\n", timeout_s=5)
    assert r.status == "ok" and r.returncode == 0, r
    reversed_line, cwd = r.stdout.splitlines()
    assert reversed_line == "cba"
    if "mountns" in r.isolation:
        assert cwd == "/tmp/work"  # in its private /tmp
    else:
        assert os.path.basename(cwd).startswith("grpo_sandbox_") and not os.path.exists(cwd)
    assert os.listdir(own) == []
    os.rmdir(own)


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


def live_processes_named(names: set[str]) -> dict[str, int]:
    """name -> PID of each process here (not a zombie) whose name (comm) is one of `names`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name in names and state != "Z":
            found[name] = int(pid)
    return found


def test_a_child_that_outlives_the_program_is_killed():
    """A plain child dies with the process group; one that escaped the group with setsid dies with
    the PID namespace, where there is one. The children name themselves (prctl PR_SET_NAME), so
    this test sees them in its own /proc: the sandbox can write no directory the host shares."""
    names = {kind: f"beat{secrets.token_hex(4)}{kind[0]}" for kind in ("plain", "escaped")}
    source = textwrap.dedent(f"""
        import ctypes, os, time
        for kind, name in {names!r}.items():
            if os.fork() == 0:
                if kind == "escaped":
                    os.setsid()
                ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
                while True:
                    time.sleep(0.02)
        def named():
            found = set()
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    found.add(open(f"/proc/{{pid}}/comm").read().strip())
                except OSError:
                    pass
            return found
        deadline = time.monotonic() + 3
        while not set({list(names.values())!r}) <= named() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("parent done" if set({list(names.values())!r}) <= named() else "children missing")
    """)
    r = run_sandboxed(source, timeout_s=5.0)
    try:
        assert r.status == "ok" and r.stdout == "parent done\n", r  # they did run
        assert group_is_gone(r.pid)
        deadline = time.monotonic() + 2  # without a PID namespace the host's init reaps the plain one
        while names["plain"] in live_processes_named(set(names.values())) and time.monotonic() < deadline:
            time.sleep(0.02)
        alive = live_processes_named(set(names.values()))
        assert names["plain"] not in alive
        if "pidns" in r.isolation:
            assert names["escaped"] not in alive
    finally:
        for pid in live_processes_named(set(names.values())).values():  # the escaped one, without a PID namespace
            os.kill(pid, signal.SIGKILL)


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
    runs as this user, and only a read-only root (a mount namespace) protects them."""
    target = tmp_path / "checkout_file"
    target.write_text("original")
    target.chmod(0o666)  # even a world-writable file: its directories are not reachable, or not writable
    source = (f"try:\n    open({str(target)!r}, 'w').write('changed')\n    print('wrote')\n"
              "except OSError:\n    print('denied')")
    r = run_sandboxed(source, timeout_s=5.0)
    protected = any(m.startswith("uid=") for m in r.isolation) or "read-only-root" in r.isolation
    assert r.stdout.strip() == ("denied" if protected else "wrote"), r
    assert target.read_text() == ("original" if protected else "changed")


def test_an_exit_status_and_a_crash_are_errors():
    assert run_sandboxed("import sys\nsys.exit(3)", timeout_s=5).returncode == 3
    r = run_sandboxed("def f():\n    raise ValueError('boom')\nf()", timeout_s=5)
    assert r.status == "error" and "ValueError: boom" in r.stderr and 'File "solution.py", line 3' in r.stderr
    assert run_sandboxed("def (:", timeout_s=5).status == "error"


def test_a_real_time_signal_is_a_kill_that_scores_zero():
    # signal.Signals has no member for SIGRTMIN+3: classifying its exit status used to raise.
    killer = "import os, signal\nos.kill(os.getpid(), signal.SIGRTMIN + 3)"
    r = run_sandboxed(killer, timeout_s=5)
    assert (r.status, r.returncode, r.detail) == ("killed", -(signal.SIGRTMIN + 3), "killed by SIGRTMIN+3")
    tests = "assert add(1, 2) == 3"
    dies = "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGRTMIN + 3)\n"
    assert code_reward(["q"] * 2, [fenced(dies), fenced(CORRECT_ADD)], tests=[tests] * 2) == [0.0, 1.0]


def test_a_spawn_failure_is_an_infrastructure_error(monkeypatch):
    sandbox_isolation()  # probe first, so only the real run meets the broken Popen

    def broken_popen(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(runner.subprocess, "Popen", broken_popen)
    r = run_sandboxed("print(1)", timeout_s=5)
    assert r.status == "infra_error" and "Too many open files" in r.detail
    assert code_reward(["q"], [fenced("def add(a, b):\n    return a + b")], tests=["assert add(1, 2) == 3"]) == [None]


def test_a_temp_dir_failure_is_an_infrastructure_error(monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner.tempfile, "mkdtemp", no_space)
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
    monkeypatch.setattr(launcher, "_find_unshare", lambda: None)
    monkeypatch.setattr(launcher, "_launchers", {})
    isolation = sandbox_isolation()
    assert "netns" not in isolation and "session" in isolation and "rlimits" in isolation
    r = run_sandboxed("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and r.wall_s < 5.0 and group_is_gone(r.pid), r
    r = run_sandboxed("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
                      "except OSError as e:\n    print(e)", timeout_s=5.0)
    assert r.stdout.strip() == "[Errno 101] network access is disabled in the sandbox", r
    exits = "def add(a, b):\n    return 0\nimport sys\nsys.exit(0)"
    # Without namespaces samples share /tmp: the code reward refuses unless told to accept that.
    with pytest.raises(ValueError, match="no userns, mountns, pidns here.*allow_weak_isolation: true"):
        code_reward(["q"], [fenced(CORRECT_ADD)], tests=[ADD_TESTS])
    assert code_reward(["q"] * 2, [fenced(CORRECT_ADD), fenced(exits)], tests=[ADD_TESTS] * 2,
                       allow_weak_isolation=True) == [1.0, 0.0]


# --- the harness: a real module, run by path, its helpers tested in-process ----------------------------

def test_the_harness_imports_only_the_standard_library():
    """It runs under `python -I` in the sandbox, where grpo_jax and site-packages may be unreachable."""
    tree = ast.parse(pathlib.Path(harness.__file__).read_text(encoding="utf-8"))
    nodes = list(ast.walk(tree))
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported - set(sys.stdlib_module_names)
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))


def test_harness_exit_code_is_what_the_interpreter_would_exit_with(capsys):
    assert harness.exit_code(SystemExit()) == 0
    assert harness.exit_code(SystemExit(3)) == 3
    assert harness.exit_code(SystemExit(256 + 7)) == 7
    assert harness.exit_code(SystemExit("bad input")) == 1
    assert capsys.readouterr().err == "bad input\n"


def test_harness_parses_each_top_level_statement_as_a_test_or_setup():
    source = '"""docstring"""\nimport math\ndef check(f):\n    assert f(1) == 1\nassert 1 == 1\ncheck(abs)\nx = 1'
    assert [test for _, test in harness.parse_tests(source)] == [0, 0, 0, 1, 1, 0]
    assert [harness.is_test(node) for node in ast.parse(source).body] == [False, False, False, True, True, False]


def test_harness_tests_namespace_drops_dunders_and_builtin_shadows():
    pristine = dict(builtins.__dict__)
    candidate = {"__name__": "solution", "__builtins__": {}, "add": len, "sorted": lambda xs: [], "_helper": 1}
    namespace = harness.tests_namespace(candidate, pristine)
    assert namespace["add"] is len and namespace["_helper"] == 1 and "sorted" not in namespace
    assert namespace["__name__"] == "__tests__" and namespace["__builtins__"] is pristine


def test_harness_runs_statements_counting_passes_and_stopping_at_a_failed_setup(capsys):
    tests = harness.parse_tests("def add(a, b):\n    return a + b\nassert add(1, 1) == 2\nassert add(1, 1) == 3\n"
                                "add(1)\nimport no_such_module_xyz\nassert add(2, 2) == 4")
    namespace = harness.tests_namespace({}, dict(builtins.__dict__))
    assert harness.run_statements(tests, namespace) == 1  # the import failed: the last assert never ran
    err = capsys.readouterr().err
    assert "AssertionError" in err and "TypeError" in err and "ModuleNotFoundError" in err


def test_harness_removes_its_own_directory_and_the_cwd_from_sys_path(tmp_path):
    here = tmp_path / "sandbox"
    here.mkdir()
    entries = ["", str(here), str(here) + "/", "/usr/lib/python3.11", str(tmp_path)]
    assert harness.clean_sys_path(entries, str(here)) == ["/usr/lib/python3.11", str(tmp_path)]


def test_the_harness_runs_by_path_from_a_copy_in_the_sandbox_directory():
    show = "import os, sys\nprint(sys.orig_argv)\nprint(os.getcwd())"
    for r in (run_sandboxed(show, timeout_s=5), run_sandboxed(show, tests="assert True", timeout_s=5)):
        assert r.status == "ok", r
        argv_line, cwd = r.stdout.splitlines()[:2]
        argv = ast.literal_eval(argv_line)
        assert argv[1] == "-I" and "-c" not in argv, argv
        assert os.path.basename(argv[2]) == ".sandbox_harness.py", argv
        assert os.path.basename(os.path.dirname(argv[2])).startswith("grpo_sandbox_"), argv
        if "mountns" not in r.isolation:  # else the program's cwd is its private /tmp/work
            assert os.path.realpath(os.path.dirname(argv[2])) == os.path.realpath(cwd), (argv, cwd)


def test_a_candidate_cannot_import_a_sibling_of_the_harness_or_a_file_it_wrote():
    source = textwrap.dedent("""
        import sys
        open("mine.py", "w").write("x = 1")
        for name in ("launcher", "harness", "mine", ".sandbox_harness"):
            try:
                __import__(name)
                print(name, "imported")
            except ImportError:
                print(name, "blocked")
        print(sorted(p for p in sys.path if "sandbox" in p or not p))
    """)
    r = run_sandboxed(source, timeout_s=5)
    assert r.status == "ok", r
    assert r.stdout.splitlines() == ["launcher blocked", "harness blocked", "mine blocked", ".sandbox_harness blocked",
                                     "[]"]


def test_the_harness_drops_its_directory_from_sys_path_even_without_isolated_mode(tmp_path):
    """Started by path without -I, Python puts the script's directory first on sys.path; the harness
    removes it before the candidate runs, so a module next to the harness stays out of reach."""
    package = tmp_path / "package"
    package.mkdir()
    shutil.copy(harness.__file__, package / "harness.py")
    (package / "sibling.py").write_text("print('sibling imported')")
    workdir = tmp_path / "work"
    workdir.mkdir()
    config = {"code": "import sibling", "tests": None, "nonce": "n", "limits": [], "unlink": []}
    config_file = tempfile.TemporaryFile()
    config_file.write(json.dumps(config).encode())
    config_file.flush()
    status_r, status_w = os.pipe()
    control_r, control_w = os.pipe()  # held open: closing it would tell the harness to stop
    try:
        proc = subprocess.run([sys.executable, str(package / "harness.py"), str(config_file.fileno()), str(status_w),
                               str(control_r)], cwd=workdir, capture_output=True, text=True, timeout=30,
                              pass_fds=(config_file.fileno(), status_w, control_r))
    finally:
        config_file.close()
        for fd in (status_w, control_r, control_w):
            os.close(fd)
    with os.fdopen(status_r, "rb") as f:
        status = f.read()
    assert "ModuleNotFoundError: No module named 'sibling'" in proc.stderr, proc
    assert "sibling imported" not in proc.stdout and status == b"S\nX 1\n"
    assert (package / "harness.py").exists()  # only the files the config names are deleted
