"""The commands that run a config: `train`, `train-rm`, `check` and `eval` (a run's checkpoint
scored on the held-out split by the trainer's own evaluation, grpo_jax.rollout.evaluation.evaluate_run)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from grpo_jax.cli.common import UsageError
from grpo_jax.config import load_config


class AfterTheRun:
    """SIGTERM and SIGINT once a run has returned, until this command's process exits (a second or
    so of interpreter and JAX teardown, when a preemption notice would otherwise end a finished run
    with status 143): the run's checkpoint and files are complete, so the signal is acknowledged in
    one line and the command still exits 0; a second one aborts at once (until the interpreter's exit
    handlers start; from then on both are ignored). The run's own handlers
    (grpo_jax.trainer.preemption) cover everything before. `keep`: stay installed when the command
    returns (the process's own command, whose exit is still ahead), else restore the handlers
    before (a caller in the same process). On several hosts JAX's preemption service keeps SIGTERM."""

    def __init__(self, *, keep: bool):
        self.keep, self.received = keep, None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> AfterTheRun:
        import atexit

        import jax

        if threading.current_thread() is threading.main_thread():
            jax_has_sigterm = jax.process_count() > 1 and jax.config.jax_enable_preemption_service
            for sig in [signal.SIGINT] + ([] if jax_has_sigterm else [signal.SIGTERM]):
                self._previous[sig] = signal.signal(sig, self._handle)
            if self.keep:
                # Python puts back the default actions of the handlers it installed while it tears
                # down after the exit handlers, but keeps SIG_IGN: from the first exit handler on
                # (this one, registered last, runs first) the signals are ignored.
                atexit.register(self._ignore)
        return self

    def _ignore(self) -> None:
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def __exit__(self, *exc) -> None:
        if not self.keep:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = name
        print(f"received {name} after the run finished: its checkpoint and files are complete; exiting "
              f"(send {name} again to abort at once)", file=sys.stderr)


def _run_dir(args: argparse.Namespace) -> str:
    """--output (a local path or gs://...), else runs/<the config's name>."""
    return args.output if args.output and "://" in args.output else str(Path(args.output or Path("runs") / Path(args.config).stem))


def _train(args: argparse.Namespace) -> int:
    from grpo_jax.runtime.devices import initialize_distributed
    from grpo_jax.trainer.loop import train

    config = load_config(args.config, args.set or ())
    initialize_distributed(config)
    result = train(config, _run_dir(args))
    with AfterTheRun(keep=args.own_process):
        if result.stopped:  # a preemption notice or Ctrl-C: saved, resumable, not an error
            print(json.dumps({"stopped": result.stopped, "step": result.step, "run_dir": result.run_dir}))
            return 0
        start, end = result.eval_start, result.eval_end
        print(json.dumps({"run_dir": result.run_dir, "metrics": f"{result.run_dir}/metrics.jsonl",
                          "plot": result.plot, "eval_accuracy_start": start["eval/accuracy"],
                          "eval_accuracy_end": end["eval/accuracy"], "eval_pass@k_start": start["eval/pass@k"],
                          "eval_pass@k_end": end["eval/pass@k"]}))
        return 0


def _check(args: argparse.Namespace) -> int:
    from grpo_jax.trainer.check import check

    check(args.config, args.set or (), for_command=args.for_command)
    return 0


def _train_rm(args: argparse.Namespace) -> int:
    from grpo_jax.config import load_rm_config
    from grpo_jax.trainer.reward_run import train_reward_model

    config = load_rm_config(args.config, args.set or ())
    result = train_reward_model(config, _run_dir(args))
    with AfterTheRun(keep=args.own_process):
        if result.stopped:  # a preemption notice or Ctrl-C: saved, resumable, not an error
            print(json.dumps({"stopped": result.stopped, "step": result.step, "run_dir": result.run_dir}))
            return 0
        print(json.dumps({"output": result.run_dir, "metrics": f"{result.run_dir}/metrics.jsonl",
                          "model": f"{result.run_dir}/hf", "rm/pair_accuracy": result.eval_end["rm/pair_accuracy"]}))
        return 0


def _eval_target(args: argparse.Namespace) -> tuple[str, Path]:
    """(the checkpoint to score: RUN_DIR or --checkpoint, the config: --config or the run's own)."""
    from grpo_jax.trainer.checkpoint import find_run

    if (args.run_dir is None) == (args.checkpoint is None):
        raise UsageError("name the run once: RUN_DIR (or --checkpoint RUN_DIR), a run directory or its "
                         "checkpoints/<step>")
    checkpoint = args.run_dir or args.checkpoint
    return checkpoint, Path(args.config) if args.config else find_run(checkpoint).run_dir / "config.yaml"


def _eval(args: argparse.Namespace) -> int:
    from grpo_jax.learner.objectives import objective_class
    from grpo_jax.models import JNP_DTYPES
    from grpo_jax.rollout.evaluation import evaluate_run
    from grpo_jax.runtime.sharding import place_model
    from grpo_jax.trainer.checkpoint import load_policy
    from grpo_jax.trainer.prepare import prepare

    checkpoint, config_path = _eval_target(args)
    config = load_config(config_path, args.set or ())
    prepared = prepare(config)  # data and reward checks before the checkpoint is read
    for note in prepared.notes:
        print(note, file=sys.stderr)
    if objective_class(config).teacher:
        print("eval: eval/distill_reverse_kl is the trainer's (it holds the teacher); this evaluation loads "
              "no teacher", file=sys.stderr)
    model, _, files = load_policy(checkpoint, dtype=JNP_DTYPES[config.model.dtype],
                                  param_dtype=JNP_DTYPES[config.model.param_dtype])
    place_model(model, prepared.eval.mesh)  # where the trainer evaluates
    if prepared.eval.retention is not None:  # KL against the run's first policy, as the trainer measured it
        prepared.eval.retention.load(files.run_dir, log=lambda line: print(line, file=sys.stderr))
    result = {"checkpoint": str(files.checkpoints / str(files.step)), "step": files.step, "config": str(config_path),
              **evaluate_run(model, prepared.eval)}
    print(json.dumps(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _plan(args) -> int:
    from grpo_jax.tools.plan import plan

    result = plan(args.config, topology=args.topology, overrides=args.set or [], preset=args.preset,
                  max_compiles=args.max_compiles)
    print(json.dumps(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result.get("fits") else 1


def _training_command(sub, name: str, func, about: str, *, example: str, output: str) -> None:
    """A command that trains from a config: --config, --set and --output (default runs/<config name>)."""
    command = sub.add_parser(name, help=about)
    command.add_argument("--config", required=True, help=f"YAML file, e.g. {example}")
    command.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.steps=10")
    command.add_argument("--output", default=None, help=f"{output} (default runs/<config name>)")
    command.set_defaults(func=func, prog=command.prog)


def add_commands(sub) -> None:
    """The parsers of `train`, `train-rm`, `check` and `eval`."""
    from grpo_jax.trainer import check as check_tool

    _training_command(sub, "train", _train, "run GRPO as a YAML config says", example="configs/demo_cpu.yaml",
                      output="run directory")
    _training_command(sub, "train-rm", _train_rm, "train a reward model on preference pairs (Bradley-Terry); saves "
                      "an HF *ForSequenceClassification directory in OUTPUT/hf", example="configs/rm_demo_cpu.yaml",
                      output="output directory")

    check = sub.add_parser("check", help="check every input of a config (model, tokenizer and chat template, "
                                         "data, rewards, installed packages) without compiling anything")
    check.add_argument("--config", required=True, help="YAML file, e.g. configs/smollm2_135m_gsm8k_cpu.yaml")
    check.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    check.add_argument("--for", dest="for_command", choices=check_tool.COMMANDS, default="train",
                       help="the command the config is for (default train)")
    check.set_defaults(func=_check, prog=check.prog)

    plan = sub.add_parser("plan", help="the fastest settings (micro-batches, remat, KV pool fraction) that fit a TPU "
                                       "slice with 20%% of HBM to spare, compiled with XLA:TPU (libtpu, no TPU), step "
                                       "time by a roofline estimate")
    plan.add_argument("--config", required=True, help="YAML file, e.g. configs/qwen3_0.6b_gsm8k_v5e8.yaml")
    plan.add_argument("--topology", required=True, metavar="NAME", help="the TPU slice, e.g. v5e:2x4 (a v5e-8)")
    plan.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    plan.add_argument("--preset", default="", help="the model's shape by name (bench.PRESETS, e.g. qwen3-1.7b) where "
                                                    "its files are not on this machine")
    plan.add_argument("--max-compiles", type=int, default=12, help="compile at most this many programs (default 12)")
    plan.add_argument("--output", default=None, help="also write the JSON result here")
    plan.set_defaults(func=_plan, prog=plan.prog)

    ev = sub.add_parser("eval", help="accuracy and pass@k (and eval.verifier's accuracy) of a run's newest checkpoint "
                                     "on the held-out split, evaluated as the trainer evaluates")
    ev.add_argument("run_dir", nargs="?", default=None, metavar="RUN_DIR",
                    help="a run directory (its newest checkpoint that restores) or its checkpoints/<step>")
    ev.add_argument("--checkpoint", default=None, metavar="RUN_DIR", help="the same as RUN_DIR")
    ev.add_argument("--config", default=None, help="YAML file (default RUN_DIR/config.yaml: the run's own)")
    ev.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. eval.k=16")
    ev.add_argument("--output", default=None, help="also write the JSON result here")
    ev.set_defaults(func=_eval, prog=ev.prog)
