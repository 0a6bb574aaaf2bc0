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
