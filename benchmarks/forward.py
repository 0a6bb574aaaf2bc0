"""Forward-pass (prefill) throughput vs transformers: `grpo-jax bench forward` (see grpo_jax/tools/bench/parity.py).

    python benchmarks/forward.py --preset tiny --output forward_cpu.json
    python benchmarks/forward.py --preset qwen3-0.6b --dtype bfloat16 --batch 16 --seq 1024
"""

from grpo_jax.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["bench", "forward", *sys.argv[1:]]))
