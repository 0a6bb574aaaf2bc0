"""The sandbox's seccomp filter: no memory outside its caps.

A sandboxed program's memory is capped per process by the address space limit (RLIMIT_AS) and its
files by the private tmpfs's size (`max_tmp_mb`, /tmp, /dev/shm, /var/tmp together). Three system
calls make memory that neither counts, because a process holds their pages without mapping them
and they live on no mount of the sandbox: memfd_create (a program held 720 MB in 45 memfds of
16 MB, each within the file-size limit), memfd_secret and SysV shmget (a segment lives on after
its detach: attach, fill, detach, repeat). The filter answers them with ENOSYS, as a kernel built
without them would: a library that tries memfd_create falls back to a file, which the tmpfs caps
(`multiprocessing.shared_memory` and `/dev/shm` files work as before). A system call of another ABI
(i386's `int 0x80` from a 64-bit process, which would reach them by other numbers) gets ENOSYS too.

`memory_filter` builds the classic BPF program here; the harness (`harness.install_filter`)
installs it before any candidate code runs, for the harness, the grader and the candidate.
"""

from __future__ import annotations

import platform

# Per 64-bit ABI (os.uname().machine): its AUDIT_ARCH, the numbers of memfd_create, memfd_secret and
# shmget, and on x86_64 the x32 bit, whose numbers reach the same calls and are refused too.
ABIS = {"x86_64": (0xC000003E, (319, 447, 29), 0x40000000), "aarch64": (0xC00000B7, (279, 447, 194), 0)}
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
_ALLOW, _ERRNO, ENOSYS = 0x7FFF0000, 0x00050000, 38  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, its errno
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


def memory_filter(machine: str | None = None) -> list[list[int]] | None:
    """The seccomp program for `machine` (default this one's) as [code, jt, jf, k] per
    instruction (jumps count from the next instruction), or None for an ABI it does not know."""
    machine = machine or platform.machine()
    if machine not in ABIS:
        return None
    arch, numbers, x32 = ABIS[machine]
    denied = sorted(set(numbers) | ({n | x32 for n in numbers} if x32 else set()))
    deny = 3 + len(denied) + 1  # the last instruction
    program = [[_LD_W_ABS, 0, 0, _ARCH], [_JEQ_K, 0, deny - 2, arch], [_LD_W_ABS, 0, 0, _NR]]
    program += [[_JEQ_K, deny - (3 + i) - 1, 0, n] for i, n in enumerate(denied)]
    return program + [[_RET_K, 0, 0, _ALLOW], [_RET_K, 0, 0, _ERRNO | ENOSYS]]
