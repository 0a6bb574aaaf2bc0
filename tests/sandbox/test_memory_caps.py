"""Memory a sandboxed program could hold outside its caps (issue 44, item 1): the address space
limit counts what a process maps, the private tmpfs what it writes in files; memfds and SysV
segments are neither, so the seccomp filter refuses them (ENOSYS). A program that tries fails
alone and scores 0; shared memory that the tmpfs caps works as before."""

from __future__ import annotations

import textwrap

import pytest

from grpo_jax.env.python_tool import PythonTool
from grpo_jax.rewards import code_reward
from grpo_jax.sandbox import launcher, run_sandboxed, sandbox_isolation
from grpo_jax.sandbox.seccomp import ABIS, ENOSYS, memory_filter

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
CORRECT = "def add(a, b):\n    return a + b"
# Each holds 720 MB (45 x 16 MB, every piece within the 16 MB file-size limit) beside a correct
# `add`: it scores 1 if it gets to hold it, 0 if refused.
HOLDERS = {
    "memfds": """
        import os
        fds = []
        for i in range(45):
            fd = os.memfd_create("m%d" % i)
            os.ftruncate(fd, 16 << 20)
            os.write(fd, b"x" * (16 << 20))
            fds.append(fd)
        def add(a, b):
            return a + b
    """,
    "SysV segments, attached one at a time": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        for _ in range(45):
            shm = libc.shmget(0, 16 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
            if shm < 0:
                raise OSError(ctypes.get_errno(), "shmget")
            at = libc.shmat(shm, None, 0)
            ctypes.memset(at, 1, 16 << 20)
            libc.shmdt(ctypes.c_void_p(at))
        def add(a, b):
            return a + b
    """,
}
SHARED_MEMORY = """
    from multiprocessing import shared_memory
    m = shared_memory.SharedMemory(create=True, size=1 << 20)
    m.buf[:2] = b"ok"
    print(bytes(m.buf[:2]).decode())
    m.close()
    m.unlink()
"""


def fenced(code: str) -> str:
    return f"```python\n{textwrap.dedent(code).strip()}\n```"


@pytest.mark.skipif(memory_filter() is None, reason="no seccomp filter for this machine's ABI")
def test_memory_outside_the_caps_fails_its_program_alone_and_scores_0():
    assert "seccomp" in sandbox_isolation()
    names = list(HOLDERS)
    rewards = code_reward(["q"] * 3, [fenced(HOLDERS[n]) for n in names] + [fenced(CORRECT)],
                          tests=[ADD_TESTS] * 3, max_workers=3, timeout_s=20)
    assert dict(zip([*names, "correct"], rewards)) == {"memfds": 0.0, "SysV segments, attached one at a time": 0.0,
                                                       "correct": 1.0}
    r = run_sandboxed(textwrap.dedent(HOLDERS["memfds"]), timeout_s=20)
    assert r.status == "error" and "[Errno 38] Function not implemented" in r.stderr, r
    answer = PythonTool(timeout_s=20).step(f"<python>{textwrap.dedent(HOLDERS['memfds'])}</python>").messages[0]
    assert "[error: exit status 1]" in answer["content"] and "Function not implemented" in answer["content"]
    shared = run_sandboxed(textwrap.dedent(SHARED_MEMORY), timeout_s=20)  # on /dev/shm: the tmpfs caps it
    assert shared.status == "ok" and shared.stdout == "ok\n", shared
    with pytest.raises(ValueError, match="max_procs must be >= 2"):
        PythonTool(max_procs=1)


@pytest.mark.skipif(memory_filter() is None, reason="no seccomp filter for this machine's ABI")
def test_without_namespaces_the_filter_still_refuses_memfds(monkeypatch):
    monkeypatch.setattr(launcher, "_find_unshare", lambda: None)
    monkeypatch.setattr(launcher, "_launchers", {})
    assert "seccomp" in sandbox_isolation() and "mountns" not in sandbox_isolation()
    r = run_sandboxed(textwrap.dedent(HOLDERS["memfds"]), timeout_s=20)
    assert r.status == "error" and "[Errno 38] Function not implemented" in r.stderr, r


def test_a_kernel_that_refuses_the_filter_leaves_it_out_and_programs_still_run(monkeypatch, caplog):
    """The launcher installs the filter in a probe sandbox first: a filter the kernel refuses (here
    one it cannot load: an unknown BPF instruction) is left out with a warning, not installed in
    every program (each would fail as an infrastructure error)."""
    monkeypatch.setattr(launcher, "memory_filter", lambda: [[0xFFFF, 0, 0, 0]])
    monkeypatch.setattr(launcher, "_launchers", {})
    with caplog.at_level("WARNING", logger=launcher.log.name):
        assert "seccomp" not in sandbox_isolation()
    assert "no seccomp memory filter" in caplog.text and "prctl" in caplog.text
    r = run_sandboxed("print(2 + 2)", timeout_s=20)
    assert r.status == "ok" and r.stdout == "4\n", r


def run_bpf(program: list, nr: int, arch: int) -> int:
    """Classic BPF as the kernel runs a seccomp filter (the three instructions it uses) on
    struct seccomp_data {nr, arch, ...} -> the filter's verdict."""
    data, a, pc = {0: nr, 4: arch}, 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:
            a, pc = data[k], pc + 1
        elif code == 0x15:
            pc += 1 + (jt if a == k else jf)
        else:
            assert code == 0x06
            return k


@pytest.mark.parametrize("machine", sorted(ABIS))
def test_the_filter_refuses_exactly_the_memory_calls_of_its_abi(machine):
    """On every ABI it knows, not only this machine's: the three calls (and x86_64's x32 aliases)
    and every call of a foreign ABI get ENOSYS; every other call is allowed."""
    program, (arch, numbers, x32) = memory_filter(machine), ABIS[machine]
    deny, allow = 0x00050000 | ENOSYS, 0x7FFF0000
    refused = {nr for nr in range(500) if run_bpf(program, nr, arch) == deny}
    assert refused == set(numbers)
    if x32:
        assert all(run_bpf(program, nr | x32, arch) == deny for nr in numbers)
        assert run_bpf(program, 1 | x32, arch) == allow  # x32's write
    assert run_bpf(program, 1, 0x40000003) == deny  # i386 (int 0x80) from a 64-bit process
    assert memory_filter("sparc") is None
