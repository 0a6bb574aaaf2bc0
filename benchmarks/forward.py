"""Forward-pass (prefill) throughput: grpo_jax's NNX decoder vs transformers' PyTorch model.

Both run the same random weights (built with transformers, saved, loaded by `from_pretrained`) on
the same token batch in the same process, so the ratio is meaningful on a noisy machine.

    python benchmarks/forward.py --preset tiny --output forward_cpu.json           # CPU
    python benchmarks/forward.py --preset qwen3-0.6b --dtype bfloat16 --batch 16 --seq 1024   # GPU

Prints one JSON object (also written to --output): tokens/s of each, the ratio, and the max abs
logit difference between the two on the benchmark batch.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

PRESETS = {
    # family, hidden, intermediate, layers, heads, kv heads, head_dim, vocab
    "tiny": dict(model_type="qwen3", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151_936,
                       tie_word_embeddings=True),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128_256,
                        tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                        rope_theta=500_000.0),
}


def _time(fn, iters: int) -> list[float]:
    fn()  # compile / warm up
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--output", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from grpo_jax.models import from_pretrained

    if args.dtype == "float32":
        # Full fp32 matmuls on both sides (GPUs default to TF32 in XLA), so the diff measures the model.
        jax.config.update("jax_default_matmul_precision", "highest")
        torch.backends.cuda.matmul.allow_tf32 = False

    spec = dict(PRESETS[args.preset])
    model_type = spec.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(tdtype).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        t = time.perf_counter()
        ours = from_pretrained(d, dtype=jnp.dtype(args.dtype), param_dtype=jnp.dtype(args.dtype))
        load_s = time.perf_counter() - t
    hf = hf.to(device)

    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    graphdef, state = nnx.split(ours)

    @jax.jit
    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids)

    ids_j = jnp.asarray(ids)
    ours_logits = forward(state, ids_j)
    ours_times = _time(lambda: forward(state, ids_j).block_until_ready(), args.iters)

    ids_t = torch.as_tensor(ids, dtype=torch.long, device=device)

    def torch_forward():
        with torch.no_grad():
            out = hf(input_ids=ids_t).logits
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    torch_logits = torch_forward().float().cpu().numpy()
    torch_times = _time(torch_forward, args.iters)
    tokens = args.batch * args.seq
    ours_tps = tokens / statistics.median(ours_times)
    torch_tps = tokens / statistics.median(torch_times)
    diff = float(np.abs(np.asarray(ours_logits) - torch_logits).max())
    result = {
        "benchmark": "forward",
        "preset": args.preset,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "jax_backend": jax.default_backend(),
        "jax_device": str(jax.devices()[0].device_kind),
        "torch_device": device if device == "cpu" else torch.cuda.get_device_name(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "host": platform.node(),
        "load_s": round(load_s, 2),
        "grpo_jax_tokens_per_s": round(ours_tps, 1),
        "transformers_tokens_per_s": round(torch_tps, 1),
        "ratio_vs_transformers": round(ours_tps / torch_tps, 3),
        "max_abs_logit_diff": diff,
        "logit_scale": float(np.abs(torch_logits).max()),
    }
    print(json.dumps(result))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
