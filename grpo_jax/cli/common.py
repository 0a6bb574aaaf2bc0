"""What every command family of the `grpo-jax` command shares: the user error, the parser that
raises it, and argparse helpers that take their defaults from the functions the commands call."""

from __future__ import annotations

import argparse
import inspect

from grpo_jax.config import ConfigError


class UsageError(Exception):
    """A mistake in the command line or in what it names. `main` reports it, as every user error,
    in one line `grpo-jax <command>: error: <message>` and exit status 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog  # the parser that refused an argument; None: the command that ran


# What `main` reports as the user's mistake, never as a traceback: the command line (argparse's
# refusals among them), a config that cannot become a run, a path that is not there.
USER_ERRORS = (UsageError, ConfigError, FileNotFoundError)


class Parser(argparse.ArgumentParser):
    """argparse whose refusals (an unknown choice, a bad value, a missing option) are UsageErrors."""

    def error(self, message: str):
        raise UsageError(message, self.prog)


def defaults(fn) -> dict:
    """`fn`'s keyword defaults: the CLI's defaults, written once, in the function it calls."""
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def call(fn, args: argparse.Namespace):
    """`fn` called with the parsed options named like its parameters."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in vars(args).items() if k in params})


def ints(minimum: int, *, many: bool = False):
    """An argparse type: an integer (`many`: comma-separated integers), each at least `minimum`."""
    def parse(text: str):
        try:
            values = [int(v) for v in text.split(",") if v.strip()] if many else [int(text)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'comma-separated integers' if many else 'an integer'}, "
                                             f"got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text!r}")
        return values if many else values[0]

    return parse
