"""The chain task's warm start, seed by seed: its held-out accuracy on the derivation reward (every
running total right) after `sft.steps` of supervised warm-up, before any RL.

Why: the credit comparison (`critique.py credit --reward derivation`, configs/chain_cpu.yaml's 500
SFT steps) found seed 0's warm start at 0.105 and seeds 1 and 2 at 0.006 and 0.000: every group of
those seeds is all wrong, no arm has an advantage to follow, and the paired comparison has one
informative seed. A warm start that leaves every seed some right answers (and room above them) is
what a comparison with power needs; this measures where that is.

    python benchmarks/credit_warmstarts.py --output benchmarks/results/critique/credit_warmstarts

Each run is `grpo-jax train` with one GRPO step (its evaluation at step 0 is the warm start's);
its metrics (gzipped) and a summary.json under --output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import critique  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--sft-steps", type=int, nargs="+", default=[800, 1200])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--fresh", action="store_true", help="run every run again (else a finished one is read back)")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    sets = ["train.steps=1", "eval.every=1", *critique.reward_sets("derivation_exact")]
    runs = []
    head = {"experiment": "credit_warmstarts", "commit": commit.strip(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python", "benchmarks/credit_warmstarts.py", *(argv or sys.argv[1:])]),
            "machine": "this project's 2-core CPU machine"}
    for steps in args.sft_steps:
        for seed in args.seeds:
            name = f"sft{steps}_s{seed}"
            records, wall = critique.train(args.output / name, "configs/chain_cpu.yaml",
                                           [*sets, f"sft.steps={steps}", f"train.seed={seed}"], args)
            first = next(r for r in records if "eval/accuracy" in r)
            runs.append({"run": name, "sft_steps": steps, "seed": seed, "wall_s": round(wall, 1),
                         "warm_start_accuracy": first["eval/accuracy"], "step": first["step"]})
            print(json.dumps(runs[-1]), flush=True)
            finished = len(runs) == len(args.sft_steps) * len(args.seeds)  # saved after every run
            critique.save(args.output / "summary.json", {**head, **({} if finished else {"finished": False}),
                                                         "wall_s": round(time.perf_counter() - t0), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
