"""The `grpo-jax` command. `smoke` exercises the model stack end to end on a tiny random model;
`bench` compares throughput with transformers. train, eval, export, plot and report arrive with the
issues that build them."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import grpo_jax


def _smoke(args: argparse.Namespace) -> int:
    if args.new_tokens < 2:
        raise SystemExit("grpo-jax smoke: --new-tokens must be at least 2")
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from grpo_jax.models import Transformer, from_pretrained, save_pretrained
    from grpo_jax.models.presets import tiny
    from grpo_jax.sampling import pad_prompts

    t0 = time.perf_counter()
    config = tiny(args.family)
    model = Transformer(config, rngs=nnx.Rngs(args.seed))
    out = Path(args.output)
    save_pretrained(model, out)
    model = from_pretrained(out)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=1)
    def extend(state, cache, ids_BT, mask_BT):
        return nnx.merge(graphdef, state).extend(ids_BT, cache, mask_BT)

    @jax.jit
    def full_pass(state, ids_BT, mask_BT):
        return nnx.merge(graphdef, state)(ids_BT, attention_mask_BT=mask_BT)

    rng = np.random.default_rng(args.seed)
    lengths = [8, 5, 3, 6]
    P = max(lengths)
    prompt, pmask = pad_prompts([rng.integers(3, config.vocab_size, n) for n in lengths], (P,), 0)
    cache = model.init_cache(len(lengths), P + args.new_tokens)
    logits, cache = extend(state, cache, jnp.asarray(prompt), jnp.asarray(pmask))
    tokens, step_logits = [], [logits[:, -1]]
    ones = jnp.ones((len(lengths), 1), jnp.int32)
    for i in range(args.new_tokens):
        if i == 1:  # the first decode step compiled; time the rest
            jax.block_until_ready(logits)
            t_decode = time.perf_counter()
        nxt = jnp.argmax(step_logits[-1], axis=-1).astype(jnp.int32)[:, None]
        tokens.append(nxt)
        logits, cache = extend(state, cache, nxt, ones)
        step_logits.append(logits[:, -1])
    jax.block_until_ready(logits)
    decode_s = time.perf_counter() - t_decode
    gen = np.asarray(jnp.concatenate(tokens, axis=1))
    ids = np.concatenate([prompt, gen], axis=1)
    mask = np.concatenate([pmask, np.ones_like(gen)], axis=1)
    full = np.asarray(full_pass(state, jnp.asarray(ids), jnp.asarray(mask)))
    cached = np.stack([np.asarray(x) for x in step_logits], axis=1)  # logits predicting ids[:, P:]
    err = float(np.abs(full[:, P - 1:] - cached).max())
    summary = {
        "family": args.family,
        "model_dir": str(out),
        "generated": gen.tolist(),
        "cache_vs_full_max_abs_diff": err,
        # Host-driven loop of one jitted step per token: a smoke figure, not the sampler's speed.
        "decode_tokens_per_s": round(len(lengths) * (args.new_tokens - 1) / decode_s, 1),
        "total_s": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(summary))
    if err > 1e-4:
        print(f"FAILED: KV-cache decode differs from the full pass by {err:.3g}", file=sys.stderr)
        return 1
    return 0


def _bench(args: argparse.Namespace) -> int:
    from grpo_jax import bench

    preset = args.preset or ("small" if args.which == "sampler" else "tiny")
    common = dict(preset=preset, dtype=args.dtype, iters=args.iters)
    if args.which == "sampler":
        result = bench.sampler(prompts=args.prompts, group_size=args.group_size, prompt_len=args.prompt_len,
                               new_tokens=args.new_tokens, **common)
    else:
        result = bench.forward(batch=args.batch, seq=args.seq, **common)
    print(json.dumps(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-jax", description=__doc__)
    parser.add_argument("--version", action="version", version=f"grpo-jax {grpo_jax.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    smoke = sub.add_parser("smoke", help="build a tiny random model, save/load it in HF format, decode with the KV cache")
    smoke.add_argument("--family", default="qwen3", choices=["llama", "qwen2", "qwen3", "gemma3_text"])
    smoke.add_argument("--output", default="runs/smoke/model", help="where the HF-format model is written")
    smoke.add_argument("--new-tokens", type=int, default=16, help="at least 2")
    smoke.add_argument("--seed", type=int, default=0)
    smoke.set_defaults(func=_smoke)

    bench = sub.add_parser("bench", help="throughput against transformers on the same weights (JSON)")
    bench.add_argument("which", choices=["sampler", "forward"])
    bench.add_argument("--preset", default=None, help="model shape: tiny, small, qwen3-0.6b, llama3.2-1b")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bench.add_argument("--iters", type=int, default=3)
    bench.add_argument("--output", default=None, help="also write the JSON result to this file")
    bench.add_argument("--prompts", type=int, default=4, help="sampler: distinct prompts")
    bench.add_argument("--group-size", type=int, default=16, help="sampler: samples per prompt")
    bench.add_argument("--prompt-len", type=int, default=32, help="sampler: prompt tokens")
    bench.add_argument("--new-tokens", type=int, default=128, help="sampler: generated tokens per row")
    bench.add_argument("--batch", type=int, default=8, help="forward: rows")
    bench.add_argument("--seq", type=int, default=128, help="forward: tokens per row")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)
