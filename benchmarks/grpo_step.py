"""Whole GRPO steps of a run config through the trainer, with a breakdown, model FLOPs and MFU:
`grpo-jax bench grpo-step`.

    python benchmarks/grpo_step.py --config benchmarks/configs/peers.yaml --output benchmarks/results/cpu_grpo_step_peers.json
"""

from grpo_jax.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["bench", "grpo-step", *sys.argv[1:]]))
