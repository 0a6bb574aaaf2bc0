"""RESULTS.md "The critique of GRPO, measured (issue 46)": the hacking, over-optimisation and
retention experiments of benchmarks/critique.py, from their summary.json files under
results/critique/ (each run's metrics beside them)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np

from figure_blocks import RESULTS, load, minutes, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paired_stats import mean_ci  # noqa: E402


def _ci(values, fmt=".3f") -> str:
    c = mean_ci(values)
    return f"{c['mean']:{fmt}}" if c["n"] < 2 else f"{c['mean']:{fmt}} [{c['lo']:{fmt}}, {c['hi']:{fmt}}]"


def _groups(runs: list[dict], key: str) -> dict:
    out = {}
    for r in runs:
        if key in r:
            out.setdefault(r[key], []).append(r)
    return out


def _flags(rs: list[dict]) -> str:
    counts = Counter(f for r in rs for f in r["flags"])
    return ", ".join(f"`{k}` {n}/{len(rs)}" for k, n in sorted(counts.items())) or "none"


def _header(d: dict) -> str:
    return (f"`{d['command']}` ({d['date']}, commit {d['commit']}, {d['machine']}; {minutes(d['wall_s'])} in all; "
            f"per-run metrics in `benchmarks/results/critique/{d['experiment']}*/`).\n\n")


def render_hacking() -> str:
    d = load("critique/hacking/summary.json")
    rows = []
    for arm, rs in _groups(d["runs"], "arm").items():
        first, last = [r["evals"][0] for r in rs], [r["evals"][-1] for r in rs]
        gap = [e["eval/accuracy"] - e["eval/verifier_accuracy"] for e in last]
        rows.append([f"`{arm}`", str(len(rs)), _ci([e["eval/accuracy"] for e in first]),
                     _ci([e["eval/accuracy"] for e in last]), _ci([e["eval/verifier_accuracy"] for e in last]),
                     _ci(gap), _ci([e["health/verifier_disagreement"] for e in last]), _flags(rs)])
    steps = d["runs"][0]["evals"][-1]["step"]
    return (_header(d) + table(["trained on", "seeds", "its own judge, step 0", f"its own judge, step {steps}",
                                f"strict verifier, step {steps}", "gap (own - strict)", "disagreement",
                                "report flags (runs)"], rows)
            + "\nMeans over seeds with 95% t intervals; 128 held-out prompts x 4 samples per evaluation.\n")


def render_overopt() -> str:
    d = load("critique/overopt/summary.json")
    rows = []
    for beta, rs in sorted(_groups(d["runs"], "beta").items()):
        gold = [[e["eval/verifier_accuracy"] for e in r["evals"]] for r in rs]
        peak = [int(np.argmax(g)) for g in gold]
        kl_peak = [r["evals"][i]["kl/k3"] or 0.0 for r, i in zip(rs, peak)]
        rows.append([f"{beta:g}", str(len(rs)), _ci([g[0] for g in gold]), _ci([max(g) for g in gold]),
                     _ci([r["evals"][i]["step"] for r, i in zip(rs, peak)], ".0f"), _ci(kl_peak, ".4f"),
                     _ci([g[-1] for g in gold]), _ci([r["evals"][-1]["kl/k3"] for r in rs], ".4f"),
                     _ci([r["evals"][0]["eval/reward_mean"] for r in rs], ".2f") + " -> "
                     + _ci([r["evals"][-1]["eval/reward_mean"] for r in rs], ".2f"), _flags(rs)])
    rm = (RESULTS / "critique/overopt/rm_wall_s.txt")
    rm_s = f" (the proxy's training: {minutes(float(rm.read_text()))})" if rm.exists() else ""
    return (_header(d) + table(["grpo.beta", "seeds", "gold at step 0", "gold at its peak", "peak step",
                                "kl/k3 at the peak", "gold at the end", "kl/k3 at the end",
                                "proxy (held-out RM score)", "report flags (runs)"], rows)
            + f"\nGold: the strict verifier's held-out accuracy; proxy: the reward model's held-out mean score{rm_s}."
            + " The curve (gold and proxy against kl/k3): `benchmarks/results/critique/overopt/overopt.png`.\n")


def render_retention(path: str) -> str:
    d = load(f"{path}/summary.json")
    rows = []
    for beta, rs in sorted(_groups(d["runs"], "beta").items()):
        first, last = [r["evals"][0] for r in rs], [r["evals"][-1] for r in rs]
        rows.append([f"{beta:g}", str(len(rs)), f"{last[0]['step']}", _ci([e["retention/kl"] for e in last], ".4f"),
                     _ci([e["retention/general_nll"] for e in first]) + " -> " + _ci([e["retention/general_nll"] for e in last]),
                     _ci([e["eval/accuracy"] for e in first]) + " -> " + _ci([e["eval/accuracy"] for e in last]),
                     _flags(rs)])
    return _header(d) + table(["grpo.beta", "seeds", "steps", "retention/kl at the end", "retention/general_nll",
                               "held-out accuracy", "report flags (runs)"], rows)


BLOCKS = {}
for _name, _fn, _file in (("critique-hacking", render_hacking, "hacking"), ("critique-overopt", render_overopt, "overopt"),
                          ("critique-retention-demo", lambda: render_retention("critique/retention_demo"), "retention_demo"),
                          ("critique-retention-smollm2", lambda: render_retention("critique/retention_smollm2"),
                           "retention_smollm2")):
    if (RESULTS / "critique" / _file / "summary.json").exists():  # a block is added with its result file
        BLOCKS[_name] = _fn
