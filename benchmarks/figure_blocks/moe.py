"""RESULTS.md "Mixture of experts (issue 45)": the MoE CPU demo with and without routing replay
(results/moe/{replay,free}/, written by benchmarks/moe_demo.sh)."""

from __future__ import annotations

import statistics

from figure_blocks import evals, load, metrics, minutes, table

ARMS = (("replay", "`sampler` (replay)"), ("free", "`none` (router chooses again)"))


def _steps(arm: str) -> list[dict]:
    return [r for r in metrics(f"moe/{arm}/metrics.jsonl") if "health/sampler_train_logprob_diff" in r]


def render_moe_demo() -> str:
    """The two arms: held-out accuracy, drift between the sampler's and the learner's log-probs,
    how often the learner's router disagreed, the routers' load."""
    rows = []
    for arm, label in ARMS:
        run, steps, ev = load(f"moe/{arm}/run.json"), _steps(arm), evals(f"moe/{arm}/metrics.jsonl")
        diff = [r["health/sampler_train_logprob_diff"] for r in steps]
        worst = max(r["health/sampler_train_logprob_diff_max"] for r in steps)
        mismatch = [r["moe/routing_mismatch"] for r in steps]
        rows.append([label, f"{ev[0]['eval/accuracy']:.3f} -> {ev[-1]['eval/accuracy']:.3f}",
                     f"{statistics.mean(diff):.2e}", f"{worst:.2e}", f"{statistics.mean(mismatch):.4f}",
                     f"{max(mismatch):.4f}", f"{steps[-1]['moe/expert_load_max']:.2f}",
                     f"{steps[-1]['moe/aux_loss']:.3f}", minutes(run["wall_s"])])
    head = ["moe.routing_replay", "held-out accuracy (step 0 -> last)", "logprob diff, mean",
            "logprob diff, max", "routing mismatch, mean", "routing mismatch, max", "expert load max (last)",
            "aux loss (last)", "wall"]
    first = load("moe/replay/run.json")
    return (f"`bash benchmarks/moe_demo.sh` ({first['date']}, commit {first['commit']}, this project's 2-core "
            "machine; the wall times ran beside other work):\n\n" + table(head, rows) +
            "\nThe log-prob diff is `health/sampler_train_logprob_diff` (mean over tokens of |sampler - learner|, "
            "per step;\nits max the largest token's); routing mismatch is `moe/routing_mismatch`, the share of "
            "scored token-layers\nwhose learner router's top-k set differs from the sampler's.\n")


BLOCKS = {"moe-demo": render_moe_demo}
