"""The `python` environment: the model writes a program in a tool call, `<python>print(3 ** 20)
</python>` (or the chat template's JSON format: grpo_jax.env.tool_calls), and the environment
runs it in the project's sandbox (grpo_jax.sandbox: its own user, mount and PID namespaces, time,
memory, process and output limits) and answers (role "tool") with what it printed, its stderr's end and how it ended (an exception's traceback, a timeout, a limit),
cut to `max_output_chars`. A model turn without a tool call is the final answer, which the run's
`rewards` score. The sandbox's isolation is checked once per process, as the code reward does: a
machine without those namespaces is refused unless `allow_weak_isolation`.

What one call's program can hold in all: `memory_mb` of address space in each of at most
`max_procs` processes, and `max_tmp_mb` of files in its private /tmp, /dev/shm and /var/tmp;
memfds and SysV shared memory, which neither limit counts, are refused (grpo_jax.sandbox.seccomp),
so a program that tries fails alone, and the model reads why.
"""

from __future__ import annotations

import functools

from grpo_jax.rewards.code import check_isolation
from grpo_jax.env.tool_calls import ToolEnvironment
from grpo_jax.sandbox import run_sandboxed


@functools.lru_cache(maxsize=4)
def _isolation(allow_weak_isolation: bool) -> str:
    return check_isolation(allow_weak_isolation=allow_weak_isolation)


class PythonTool(ToolEnvironment):
    """One episode with the Python tool (see the module docstring)."""

    argument = "code"
    description = "Run a Python program and return what it prints."

    def __init__(self, tag: str = "python", timeout_s: float = 5.0, memory_mb: int = 512,
                 max_output_chars: int = 1000, allow_weak_isolation: bool = False, tool_format: str = "tags",
                 max_procs: int = 8, max_tmp_mb: int = 64):
        if timeout_s <= 0 or memory_mb <= 0 or max_output_chars <= 0 or max_tmp_mb <= 0:
            raise ValueError("python: timeout_s, memory_mb, max_output_chars and max_tmp_mb must be positive")
        if max_procs < 2:
            raise ValueError(f"python: max_procs must be >= 2 (the sandbox's supervisor and the program), got {max_procs}")
        super().__init__(tag, tool_format, who="python")
        _isolation(bool(allow_weak_isolation))
        self.timeout_s, self.memory_mb, self.max_output_chars = float(timeout_s), int(memory_mb), int(max_output_chars)
        self.max_procs, self.max_tmp_mb = int(max_procs), int(max_tmp_mb)

    def run(self, code: str) -> str:
        result = run_sandboxed(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_procs=self.max_procs,
                               max_tmp_mb=self.max_tmp_mb, max_output_bytes=4 * self.max_output_chars)
        return self.report(result)

    def report(self, result) -> str:
        """stdout, then (if it did not end well) how it ended and the end of stderr, within the limit."""
        parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
        if result.status != "ok":
            parts.append(f"[{result.status}{': ' + result.detail if result.detail else ''}]")
            if result.stderr.strip():
                parts.append(result.stderr.strip()[-self.max_output_chars // 2:])
        text = "\n".join(parts) or "[no output]"
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars - 14] + "\n[... cut ...]"
        return text
