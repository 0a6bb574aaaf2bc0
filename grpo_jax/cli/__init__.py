"""The `grpo-jax` command: `train` runs GRPO from a YAML config, `train-rm` trains a reward model on
preference pairs, `eval` scores a run's checkpoint on the held-out split (as the trainer does),
`export` writes a checkpoint as a Hugging Face model directory, `plot` draws a run's metrics,
`report` writes its health report (HTML); `check` checks a config's inputs without compiling;
`fetch-model` puts a real model's GGUF file in the cache; `smoke` exercises the model stack on a
tiny random model; `bench BENCHMARK` measures throughput and memory (grpo_jax.tools.bench).

A user error (a bad option, a config that cannot run, a missing path) is one line on stderr,
`grpo-jax <command>: error: <message>`, and exit status 2; a fault of the run's surroundings that
stopped it (grpo_jax.faults.RunFault: a checkpoint the storage could not take, ...) or storage that
filled up under any other write is one such line with exit status 1."""

from __future__ import annotations

import argparse
import errno
import os
import sys

import grpo_jax
# One module per family of commands: run (train, train-rm, check, eval), models (export,
# fetch-model), observe (plot, report, smoke), bench; common holds what they share.
from grpo_jax.cli import bench, models, observe, run
from grpo_jax.cli.common import USER_ERRORS, Parser, UsageError
from grpo_jax.faults import RunFault


def build_parser() -> argparse.ArgumentParser:
    """`grpo-jax`'s parser: one subcommand per command, each with `func` (what runs it) and `prog`."""
    parser = Parser(prog="grpo-jax", description=__doc__)
    parser.add_argument("--version", action="version", version=f"grpo-jax {grpo_jax.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for family in (run, models, observe, bench):
        family.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `grpo-jax ARGV`; every user error (USER_ERRORS) is one line on stderr and status 2."""
    # transformers' import-time advice ("PyTorch was not found": we use it for tokenizers only) is
    # not for our users; an explicit TRANSFORMERS_VERBOSITY still wins.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    prog = parser.prog
    try:
        args, extra = parser.parse_known_args(argv)
        prog = getattr(args, "prog", prog)  # the command's own parser: "grpo-jax bench sampler"
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        if args.command is None:
            parser.print_help()
            return 0
        args.own_process = argv is None  # the process's own command (its exit follows), not a caller's call
        return args.func(args)
    except USER_ERRORS as e:  # the user's input: a message, not a traceback
        print(f"{getattr(e, 'prog', None) or prog}: error: {e}", file=sys.stderr)
        return 2
    except RunFault as e:  # the run's surroundings (a full disk, ...): one line, what was kept kept
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"{prog}: error: {full_storage(e)}", file=sys.stderr)
        return 1


def full_storage(e: OSError) -> str:
    """The line for storage that filled up under any of the command's writes (metrics, logs, an
    export): the RunFault it interrupted if there was one (it says more), else the error and where."""
    cause = e.__context__
    while cause is not None and not isinstance(cause, RunFault):
        cause = cause.__context__
    if cause is not None:
        return str(cause)
    where = f" writing {e.filename}" if e.filename else ""
    return (f"{e.strerror} ({errno.errorcode[e.errno]}){where}; free space, then run the same command again "
            "(a run resumes from its newest checkpoint)")
