"""Multi-turn episodes before and after the per-slot engine folded into the paged one (issue 61):
`configs/demo_cpu_tools.yaml` (calculator episodes, `sampling.engine: continuous`) trained a few
steps by the tree before the fold and by this one, alternately, each run in its own process; the
sampling seconds per step (`perf/sample_s`, the median over the steps after the first two, which
compile) and whether the runs' other metrics agree.

    git worktree add /tmp/wt_old 407720b
    for i in 1 2; do for tree in old new; do
      PYTHONPATH=$([ $tree = old ] && echo /tmp/wt_old || echo .) JAX_PLATFORMS=cpu python -m grpo_jax train \\
        --config configs/demo_cpu_tools.yaml --set sft.steps=0 --set train.steps=12 --set eval.every=0 \\
        --set checkpoint.every=0 --output /tmp/tools_runs/${tree}_$i
    done; done
    python benchmarks/engine_fold_episodes.py /tmp/tools_runs benchmarks/results/engine_fold/tools_episodes.json $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

TIMING = ("perf/", "env/time_s")  # seconds, which differ between any two runs


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main(runs_dir: str, output: str) -> dict:
    runs = {p.name: rows(p) for p in sorted(Path(runs_dir).iterdir()) if (p / "metrics.jsonl").exists()}
    sample = {name: statistics.median(r["perf/sample_s"] for r in rs[2:]) for name, rs in runs.items()}
    old = statistics.median(v for k, v in sample.items() if k.startswith("old"))
    new = statistics.median(v for k, v in sample.items() if k.startswith("new"))

    def learning(rs):  # what a run learned and sampled, without its timings
        return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rs]

    first = learning(next(iter(runs.values())))
    result = {"benchmark": "engine_fold_episodes", "config": "configs/demo_cpu_tools.yaml",
              "settings": ["sft.steps=0", "train.steps=12", "eval.every=0", "checkpoint.every=0"],
              "old_tree": "407720b (the per-slot engine's own episodes)", "new_tree": sys.argv[3] if len(sys.argv) > 3 else None,
              "sample_s_median_per_run": {k: round(v, 4) for k, v in sample.items()},
              "sample_s_old": round(old, 4), "sample_s_new": round(new, 4), "new_over_old": round(new / old, 3),
              "other_metrics_equal": all(learning(rs) == first for rs in runs.values())}
    Path(output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
