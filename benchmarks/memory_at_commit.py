"""An older commit's train step compiled alone, in `grpo-jax bench memory`'s JSON (issue 41: the
"before" figures of benchmarks/RESULTS.md, "Memory per length"). The older code's own `bench memory`
functions build and compile it; its samplers are neither lowered nor compiled (that code has no
--programs option, and they cost minutes at these lengths).

    mkdir -p /tmp/e1d5465 && git archive e1d5465 grpo_jax | tar -x -C /tmp/e1d5465
    python benchmarks/memory_at_commit.py /tmp/e1d5465 OUT.json --topology v5e:2x4 --preset qwen3-0.6b \
        --config configs/qwen3_0.6b_gsm8k_v5e8.yaml --set train.micro_batches=4 --set sampling.max_new_tokens=8192

TREE is a directory holding that commit's `grpo_jax` package; the run's "code" field names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree")
    parser.add_argument("out")
    parser.add_argument("--topology", required=True)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    chips = [int(n) for n in re.findall(r"\d+", args.topology.split(":", 1)[1])]
    os.environ["JAX_PLATFORMS"] = "cpu"
    # As many host devices as chips before JAX starts, so the measurement runs in this process (a
    # child process would import the working tree's grpo_jax, not TREE's).
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={eval('*'.join(map(str, chips)))}"
    sys.path.insert(0, os.path.abspath(args.tree))
    runs = importlib.import_module("grpo_jax.tools.bench.abstract_run")
    memory = importlib.import_module("grpo_jax.tools.bench.memory")
    if not runs.__file__.startswith(os.path.abspath(args.tree)):
        raise SystemExit(f"grpo_jax came from {runs.__file__}, not {args.tree}")
    runs._sampler = lambda *a, **k: None  # not lowered
    whole = runs.abstract_run

    def train_step_only(*a, **k):
        run = whole(*a, **k)
        left = {n: "not asked (train step only)" for n in run.programs if n != "train_step"}
        return dataclasses.replace(run, programs={"train_step": run.programs["train_step"]},
                                   not_compiled={**run.not_compiled, **left})

    def no_child(*a, **k):
        raise SystemExit("bench memory would measure in a child process (the working tree's code)")

    runs.abstract_run, memory._in_child = train_step_only, no_child
    result = memory.memory(args.config, overrides=args.overrides, topology=args.topology, preset=args.preset)
    result["code"] = f"{os.path.basename(os.path.normpath(args.tree))} ({args.tree})"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(result["verdict_line"])


if __name__ == "__main__":
    main()
