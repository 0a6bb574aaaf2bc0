"""`grpo-jax bench BENCHMARK`: one parser per benchmark of grpo_jax.tools.bench, its options taken
from the benchmark function's own keyword defaults; the JSON result on stdout (and in --output)."""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
from pathlib import Path

from grpo_jax.cli.common import UsageError, call, defaults, ints


def _bench(args: argparse.Namespace) -> int:
    result = args.run(args)
    print(json.dumps(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _bench_parity(fn, args: argparse.Namespace) -> dict:
    from grpo_jax.tools import bench

    try:
        bench.require_torch()
    except ImportError as e:
        raise UsageError(str(e)) from None
    return call(fn, args)


# `bench scaling`'s sweep options: axis of bench.SCALING_AXES -> (option, metavar letter, what it sweeps).
_SWEEP_OPTIONS = {"group_size": ("--group-sizes", "G", "group sizes"),
                  "completion_len": ("--completion-lens", "T", "completion lengths"),
                  "prompts_per_step": ("--prompt-counts", "N", "prompts per step")}


def _bench_scaling(args: argparse.Namespace) -> dict:
    from grpo_jax.tools import bench

    sweeps = {axis: getattr(args, axis) for axis in _SWEEP_OPTIONS if getattr(args, axis)}
    result = bench.scaling(args.config_path, overrides=args.overrides, sweeps=sweeps or None, steps=args.steps,
                           warmup=args.warmup, log=lambda line: print(line, file=sys.stderr, flush=True))
    plot = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
    if plot:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        bench.plot_scaling(result, plot)
        result["plot"] = plot
    return result


# What an option left unset ("" or 0) means, where the benchmark fills it in (memory's).
_UNSET = {"preset": "the config's model", "devices": "8, or the topology's chips", "chip": "v5e, or the topology's"}


def add_commands(sub) -> None:
    """`grpo-jax bench BENCHMARK`: one parser per benchmark (grpo_jax.tools.bench)."""
    from grpo_jax.tools import bench
    from grpo_jax.tools.bench.programs import PROGRAMS as MEMORY_PROGRAMS

    parser = sub.add_parser("bench", help="throughput (JSON): sampler and forward against transformers on the same "
                                          "weights; grpo-step: whole GRPO steps of a run config, with MFU; "
                                          "scaling: grpo-step against group size, completion length, prompts; "
                                          "engine: static vs paged rollout engines at one KV budget; "
                                          "memory: a run config's compiled memory per device against a chip's HBM")
    which = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    _bench_command(which, "sampler", bench.sampler, functools.partial(_bench_parity, bench.sampler),
                   "generated tokens/s of the sampler against transformers' generate, and shared prefill")
    _bench_command(which, "forward", bench.forward, functools.partial(_bench_parity, bench.forward),
                   "prefill (forward) tokens/s against transformers, and the max logit difference")
    _bench_command(which, "grpo-step", bench.grpo_step, functools.partial(call, bench.grpo_step),
                   "whole GRPO steps of a run config through the trainer: timings, model FLOPs, MFU")
    scaling = _bench_command(which, "scaling", bench.scaling, _bench_scaling,
                             "grpo-step against group size, completion length and prompts per step, one changed "
                             "at a time, --steps and --warmup at each point (JSON and PNG)")
    for axis, (option, letter, what) in _SWEEP_OPTIONS.items():
        scaling.add_argument(option, dest=axis, type=ints(1, many=True), default=None, metavar=f"{letter},{letter},...",
                             help=f"{what} to sweep (default {','.join(map(str, bench.SCALING_AXES[axis][1]))}; "
                                  "with no sweep option, every default sweep runs)")
    scaling.add_argument("--plot", default=None, help="the PNG (default: --output with .png)")
    _bench_command(which, "engine", bench.engine, functools.partial(call, bench.engine),
                   "static (in batches of sampling.slots rows, and all rows at once) vs paged (a reservation per slot, and a pool) (JSON, PNG)")
    memory = _bench_command(which, "memory", bench.memory, functools.partial(call, bench.memory),
                            "a run config's programs compiled on abstract shapes: memory per device against a "
                            "chip's HBM (XLA:CPU on host devices, or XLA:TPU for a --topology)")
    memory.add_argument("--topology", default="", metavar="NAME",
                        help="compile with XLA:TPU for this TPU slice instead (libtpu, the tpu-compile extra; no TPU "
                             "needed), e.g. v5e:2x4 (a v5e-8), v5e:4x4, v6e:2x2, v5p:2x2x1; the config's mesh must "
                             "use every chip, and the chip is the name's")
    memory.add_argument("--programs", type=_names, default=(), metavar="NAME,NAME,...",
                        help=f"compile only these programs (of {', '.join(MEMORY_PROGRAMS)}; default: every one "
                             "the run has); the others are listed in not_compiled")


def _names(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _bench_command(which, name: str, fn, run, about: str) -> argparse.ArgumentParser:
    from grpo_jax.tools import bench

    parser = which.add_parser(name, help=about, description=about)
    params = inspect.signature(fn).parameters
    if "config_path" in params:
        parser.add_argument("--config", dest="config_path", required=True, metavar="FILE",
                            help="the run config (YAML), e.g. benchmarks/configs/peers.yaml")
        parser.add_argument("--set", dest="overrides", action="append", default=list(params["overrides"].default),
                            metavar="KEY=VALUE", help="override a config key")
    for key, default in defaults(fn).items():
        if key in bench.OPTIONS:
            shown = _UNSET.get(key, "%(default)s") if default in ("", 0) else "%(default)s"
            parser.add_argument("--" + key.replace("_", "-"), type=type(default), default=default,
                                choices=bench.CHOICES.get(key), help=f"{bench.OPTIONS[key]} (default {shown})")
    parser.add_argument("--output", default=None, metavar="FILE.json", help="also write the JSON result to this file")
    parser.set_defaults(func=_bench, run=run, prog=parser.prog)
    return parser

