"""A process sandbox for untrusted Python programs (the code reward's candidates).

The sandbox (`run_sandboxed`) is a separate process tree, never this interpreter:
- its own session and process group; at the wall-clock timeout (or an output flood) the harness
  kills the program and exits, which takes down everything in the PID namespace, and the process
  group is SIGKILLed as a backstop, so nothing of it is left when `run_sandboxed` returns;
- where unprivileged user namespaces work (`unshare`), its own user, network, mount, PID and IPC
  namespaces: no network interface but a down loopback; its own /proc, in which no process
  outside the sandbox is visible; every process it starts dies with it, including ones that
  left the process group with `setsid`; and its own SysV message queues, shared memory and
  semaphores and POSIX message queues, gone with it (where `unshare --ipc` fails, the sandbox
  runs without and the start-up log says so);
- with a mount namespace, every mount read-only, then its own tmpfs for /tmp, /dev/shm, /var/tmp
  and /run/lock (= /var/lock) (`max_tmp_mb` in total; its cwd and HOME inside), so no sample
  sees the host's or another sample's files there, and nothing it writes outlives it or reaches
  the host; then every capability is dropped (no_new_privs), so it cannot unmount them. The
  launcher's probe runs this set-up at start and `sandbox_shared` lists what stayed writable and
  shared with the host (normally nothing), which the run logs beside the isolation;
- when this process is root, the program runs as `nobody` (uid 65534), so it cannot read /root;
  with a user namespace alone, it would keep root's access to files. When this process is not
  root, the program runs as this user and can read what this user can;
- rlimits set before any model code runs: CPU seconds, address space (memory), file size,
  process count (only where it counts the sandbox's own processes: in its own user namespace or
  uid) and no core dumps; and not dumpable, so concurrent sandboxes running as the same uid
  cannot ptrace or read each other;
- a seccomp filter (`seccomp`, on x86_64 and aarch64) refusing memfd_create, memfd_secret and SysV
  shmget with ENOSYS: memory a process holds without mapping it, which neither the address-space
  limit nor the tmpfs's size counts (grpo_jax.sandbox.seccomp); so a program's memory is its
  processes' address space and its files on the capped tmpfs;
- `python -I` (isolated: no PYTHON* variables, no user site, neither the cwd nor the harness's
  directory on sys.path), a minimal environment without proxies, a fresh temporary directory as
  cwd that is deleted afterwards, and `socket` refusing internet sockets as a second line where no
  network namespace exists;
- stdout and stderr read with a cap: a flood is cut off and the process tree killed.
An infrastructure failure (no interpreter, no temp dir, cannot spawn, the sandbox's own
supervisor dying) is `status="infra_error"`. Linux only (namespaces, pidfd, prctl).

With `tests`, a trusted harness (`harness.py`, run by path inside the sandbox) forks the grader
(`grader.py`) before any candidate code runs, then the candidate's process, which runs the
candidate as module `solution` and answers the grader's calls over a pipe pair. The grader alone
holds the tests, the `calls` and a random per-run nonce: it runs each top-level test statement in
its own interpreter, the candidate's names there being stand-ins that call over the pipe and get
back plain data only (or handles usable through attributes and methods), then evaluates the
`calls`, whose values go back as plain data for the caller to compare outside the sandbox, and
writes the nonce, the pass count and those values on the status pipe, which the candidate's
process never has. Code reaches the sandbox on an inherited descriptor of an unlinked file, the
tests on another that only the grader gets: neither has a name another sample could open. A
program that kills the harness or the grader is a failure, not an infrastructure error. The
process limits are the security boundary; see `grpo_jax.rewards.code` for what the grading does
and does not trust.

Modules: `launcher` (probing how a sandbox starts on this machine), `runner` (starting and
supervising a run), `result` (classifying what it came to), `harness` (the code that runs inside
the sandbox) and `grader` (the grader and its pipe to the candidate); the last two standard library only.
"""

from grpo_jax.sandbox.launcher import sandbox_isolation, sandbox_shared
from grpo_jax.sandbox.result import SandboxResult, SandboxStatus
from grpo_jax.sandbox.runner import run_sandboxed

__all__ = ["SandboxResult", "SandboxStatus", "run_sandboxed", "sandbox_isolation", "sandbox_shared"]
