"""Sampler throughput vs transformers' generate, and shared-prefill cost: `grpo-jax bench sampler`.

    python benchmarks/sampler.py --preset small --prompts 4 --group-size 16 --new-tokens 128 --output sampler_cpu.json
"""

from grpo_jax.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["bench", "sampler", *sys.argv[1:]]))
