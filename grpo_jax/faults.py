"""Faults of a run's surroundings, not of its input: storage that fills up or cannot be written
(grpo_jax.trainer.checkpoint_faults.CheckpointError), ... A `RunFault` stops the run after keeping
what could be kept; its message is one line that says what happened, where, and how to go on. The
`grpo-jax` command prints it as `grpo-jax <command>: error: <message>` with exit status 1 (a user
error, grpo_jax.config.ConfigError, is status 2). Nothing here imports a framework: the CLI catches
these before it has loaded JAX."""

from __future__ import annotations


def one_line(error: BaseException | str, limit: int = 400) -> str:
    """A message (or an exception's) as one printable line of at most about `limit` characters
    (user code's exceptions may carry megabytes, newlines or lone surrogates, or fail to print)."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a __str__ that raises
        return "(its message could not be printed)"
    text = " ".join(text.encode("utf-8", "backslashreplace").decode("utf-8").splitlines())
    return text if len(text) <= limit else f"{text[:limit]} [... {len(text) - limit} more characters]"


class RunFault(RuntimeError):
    """A fault that stopped the run; `str(fault)` is the one line to show (made one line here,
    whatever the message carries: a user's error text may hold newlines)."""

    def __init__(self, message: str):
        super().__init__(one_line(message, limit=2000))
