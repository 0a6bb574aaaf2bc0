"""Faults of a run's surroundings, not of its input: storage that fills up or cannot be written
(grpo_jax.trainer.checkpoint_faults.CheckpointError), ... A `RunFault` stops the run after keeping
what could be kept; its message is one line that says what happened, where, and how to go on. The
`grpo-jax` command prints it as `grpo-jax <command>: error: <message>` with exit status 1 (a user
error, grpo_jax.config.ConfigError, is status 2). Nothing here imports a framework: the CLI catches
these before it has loaded JAX."""

from __future__ import annotations


class RunFault(RuntimeError):
    """A fault that stopped the run; `str(fault)` is the one line to show."""
