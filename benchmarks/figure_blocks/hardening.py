"""RESULTS.md "Hardening: user code that hangs (issue 44)": the warm start with a user environment
in worker processes against the built-in calculator (results/warm_start_env.json)."""

from __future__ import annotations

from figure_blocks import load


def render_warm_start_env() -> str:
    """RESULTS.md: seconds per warm-start step, a user environment against the calculator."""
    r = load("warm_start_env.json")
    return (f"`python benchmarks/warm_start_env.py --steps {r['sft_steps']}` ({r['date']}, this project's 2-core "
            f"machine): the tools demo's supervised\nwarm start (`{r['config']}`) ran {r['calculator_s_per_step']:.2f} s "
            f"a step with the built-in calculator and {r['user_env_s_per_step']:.2f} s with\na two-turn user "
            f"environment (`{r['user_env']}`) in worker processes: {r['ratio']:.2f}x (the issue's\n"
            "target: within 1.5x). The slow-down the issue reports did not reproduce at the code before this change\n"
            "(a run of it, not kept in a file, had the user environment at the calculator's speed there too); the\n"
            "worked episodes now play side by side, each call under its time limit\n"
            "(`benchmarks/results/warm_start_env.json`).\n")


BLOCKS = {"hardening-warm-start": render_warm_start_env}
