"""Seconds per step of the tools demo's supervised warm start (configs/demo_cpu_tools.yaml) with the
built-in calculator and with a user environment named `module:Class` (issue 44: a two-turn user
environment answering with a short string ran 6.6 s a step against the calculator's 0.6 s).

    python benchmarks/warm_start_env.py --steps 20 --output benchmarks/results/warm_start_env.json

Each environment: `sft.steps` steps of the warm start (the SFT step compiles on the first); the
time per step is taken between the first and the last of its five log lines, so the compile is
left out. The user environment runs in worker processes (environment.workers, default 4), the
calculator in the trainer's process. `--profile` writes a cProfile of the user environment's run
next to the output (`python -m pstats`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import sys
import time
from pathlib import Path

TINY_ENV = "benchmarks.warm_start_env:TwoTurns"


class TwoTurns:
    """A user environment: the first turn gets a short string back, the second ends the episode."""

    def __init__(self):
        self.turns = 0

    def reset(self, example: dict) -> list[dict]:
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, completion: str):
        from grpo_jax.env.protocol import EnvStep

        self.turns += 1
        if self.turns == 1:
            return EnvStep(messages=[{"role": "tool", "content": "42"}])
        return EnvStep(messages=[], done=True)


def seconds_per_step(env: str | None, steps: int, data_dir: str, profile: Path | None = None) -> float:
    from grpo_jax.config import load_config
    from grpo_jax.models.build import build_model
    from grpo_jax.runtime.sharding import place_model
    from grpo_jax.trainer.prepare import prepare
    from grpo_jax.trainer.warm_start import warm_start

    overrides = [f"sft.steps={steps}", f"data.data_dir={data_dir}"]
    if env:
        overrides += [f"environment.name={env}", "environment.kwargs={}"]
    cfg = load_config(Path(__file__).parent.parent / "configs/demo_cpu_tools.yaml", overrides)
    prepared = prepare(cfg)
    model = build_model(cfg.model, prepared.model.config, cfg.train.seed, prepared.mesh)
    place_model(model, prepared.mesh)
    marks = []

    def log(line: str) -> None:
        marks.append(time.perf_counter())
        print(f"  {env or 'calculator'}: {line}", file=sys.stderr)

    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    warm_start(prepared, model, log)
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile)
    every = max(1, steps // 5)
    return (marks[steps // every - 1] - marks[0]) / (steps - every)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--env", default=TINY_ENV, help="the user environment, module:Class")
    parser.add_argument("--data-dir", default="data/tfds")
    parser.add_argument("--output", default="benchmarks/results/warm_start_env.json")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.output)
    built_in = seconds_per_step(None, args.steps, args.data_dir)
    user = seconds_per_step(args.env, args.steps, args.data_dir,
                            out.with_suffix(".prof") if args.profile else None)
    result = {"config": "configs/demo_cpu_tools.yaml", "sft_steps": args.steps, "user_env": args.env,
              "calculator_s_per_step": round(built_in, 4), "user_env_s_per_step": round(user, 4),
              "ratio": round(user / built_in, 3), "machine": platform.machine(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
