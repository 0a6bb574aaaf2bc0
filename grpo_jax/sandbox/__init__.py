"""A process sandbox for untrusted Python programs (the code reward's candidates).

The sandbox (`run_sandboxed`) is a separate process tree, never this interpreter:
- its own session and process group; at the wall-clock timeout (or an output flood) the harness
  kills the program and exits, which takes down everything in the PID namespace, and the process
  group is SIGKILLed as a backstop, so nothing of it is left when `run_sandboxed` returns;
- where unprivileged user namespaces work (`unshare`), its own user, network, mount and PID
  namespaces: no network interface but a down loopback; its own /proc, in which no process
  outside the sandbox is visible; and every process it starts dies with it, including ones that
  left the process group with `setsid`;
- with a mount namespace, its own tmpfs for /tmp, /dev/shm and /var/tmp (`max_tmp_mb` in total;
  its cwd and HOME inside), so no sample sees the host's or another sample's temporary files and
  nothing it writes there outlives it; then every capability is dropped (no_new_privs), so it
  cannot unmount them;
- when this process is root, the program runs as `nobody` (uid 65534), so it cannot write the
  checkout or read /root; with a user namespace alone, it would keep root's access to files.
  When this process is not root, the program runs as this user and can read what this user can
  (the root filesystem is not remounted read-only);
- rlimits set before any model code runs: CPU seconds, address space (memory), file size,
  process count (only where it counts the sandbox's own processes: in its own user namespace or
  uid) and no core dumps; and not dumpable, so concurrent sandboxes running as the same uid
  cannot ptrace or read each other;
- `python -I` (isolated: no PYTHON* variables, no user site, neither the cwd nor the harness's
  directory on sys.path), a minimal environment without proxies, a fresh temporary directory as
  cwd that is deleted afterwards, and `socket` refusing internet sockets as a second line where no
  network namespace exists;
- stdout and stderr read with a cap: a flood is cut off and the process tree killed.
An infrastructure failure (no interpreter, no temp dir, cannot spawn, the sandbox's own
supervisor dying) is `status="infra_error"`. Linux only (namespaces, pidfd, prctl).

With `tests`, a trusted harness (`harness.py`, run by path inside the sandbox) runs the candidate
as module `solution`, then each top-level test statement in a separate namespace that holds the
candidate's names and a copy of the builtins taken before the candidate ran, then the `calls`
whose values it returns as plain data for the caller to compare outside the sandbox, and only
when all have run it prints a random per-run nonce with the pass count and those values. Code,
tests, calls and nonce reach the sandbox on an inherited descriptor of an unlinked file: they
never have a name another sample could open. A program that kills the harness is a failure
("killed"), not an infrastructure error. The process limits are the security boundary; see
`grpo_jax.rewards.code` for what the grading does and does not trust.

Modules: `launcher` (probing how a sandbox starts on this machine), `runner` (starting and
supervising a run), `result` (classifying what it came to) and `harness` (the code that runs
inside the sandbox; standard library only).
"""

from grpo_jax.sandbox.launcher import sandbox_isolation
from grpo_jax.sandbox.result import SandboxResult, SandboxStatus
from grpo_jax.sandbox.runner import run_sandboxed

__all__ = ["SandboxResult", "SandboxStatus", "run_sandboxed", "sandbox_isolation"]
