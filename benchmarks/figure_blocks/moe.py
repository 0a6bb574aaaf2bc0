"""RESULTS.md "Mixture of experts (issue 45)": the MoE CPU demo with and without routing replay
(results/moe/{replay,free}/, written by benchmarks/moe_demo.sh)."""

from __future__ import annotations

import statistics

from figure_blocks import evals, load, metrics, minutes, table

ARMS = (("replay", "`sampler`, float32"), ("free", "`none`, float32"), ("replay_bf16", "`sampler`, bfloat16"),
        ("free_bf16", "`none`, bfloat16"))


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
                     f"{steps[-1]['moe/aux_loss']:.3f}", minutes(run["wall_s"]), run["commit"]])
    head = ["moe.routing_replay, compute", "held-out accuracy (step 0 -> last)", "logprob diff, mean",
            "logprob diff, max", "routing mismatch, mean", "routing mismatch, max", "expert load max (last)",
            "aux loss (last)", "wall", "commit"]
    first = load("moe/replay/run.json")
    return (f"`bash benchmarks/moe_demo.sh` ({first['date']}, this project's 2-core machine; the wall times ran "
            "beside other work):\n\n" + table(head, rows) +
            "\nThe log-prob diff is `health/sampler_train_logprob_diff` (mean over tokens of |sampler - learner|, "
            "per step;\nits max the largest token's); routing mismatch is `moe/routing_mismatch`, the share of "
            "scored token-layers\nwhose learner router's top-k set differs from the sampler's.\n")


BLOCKS = {"moe-demo": render_moe_demo}


GIB = 1 << 30
PROGRAMS = ("sampler", "eval_sampler", "train_step")
# Each program compiled in a command of its own (`--programs NAME`): XLA:TPU's compile of a
# sampler of this model takes up to 19 GB of host memory, two in one process more than this
# machine's 24.
PODS = (("moe/memory_v5p16_{}.json", "v5p-16"), ("moe/memory_v5e64_{}.json", "v5e-64"))


def _pod(pattern: str) -> tuple[dict, dict, str]:
    """(the train step's result file, each program's figures, the verdict line) of one config."""
    runs = {name: load(pattern.format(name)) for name in PROGRAMS}
    progs = {name: d["programs"][name] for name, d in runs.items()}
    d = runs["train_step"]
    fits = all(r["verdict"] == "fits" for r in runs.values())
    peak = max(progs, key=lambda n: progs[n]["peak_bytes"])
    hbm, top = d["hbm_bytes"], progs[peak]["peak_bytes"]
    verdict = (f"{'fits' if fits else 'does not fit'} on {d['chip']} ({hbm / GIB:.0f} GiB): peak {top / GIB:.2f} "
               f"GiB ({peak}), margin {(hbm - top) / GIB:.2f} GiB ({(hbm - top) / hbm:.0%})")
    return d, progs, verdict


def _cell(p: dict) -> str:
    return f"{p['peak_bytes'] / GIB:.2f}" if p.get("compiled", True) else f"refused ({p.get('required_bytes', 0) / GIB:.2f} needed)"


def render_moe_pods() -> str:
    """XLA:TPU's compiles of the Qwen3-30B-A3B configs, GiB per chip per program."""
    rows = []
    for pattern, slice_name in PODS:
        d, progs, verdict = _pod(pattern)
        mesh = ", ".join(f"{a} {n}" for a, n in d["mesh"].items() if n != 1) or "-"
        rows.append([f"`{d['config']}`", f"{slice_name} ({d['topology']})", mesh, *(_cell(progs[n]) for n in PROGRAMS),
                     verdict])
    head = ["config", "slice", "mesh", "sampler", "evaluation sampler", "train step", "verdict"]
    return ("`grpo-jax bench memory --config CONFIG --topology TOPOLOGY --preset qwen3-30b-a3b --programs PROGRAM` "
            "(XLA:TPU\nfrom libtpu, no chip; GiB per chip, each program's peak with what the run holds meanwhile; "
            "`benchmarks/results/moe/memory_*_PROGRAM.json`):\n\n" + table(head, rows))


def _header(pattern: str):
    def render() -> str:
        d, progs, verdict = _pod(pattern)
        return (f"Compiled ({d['topology']}), GiB per chip at its peak: sampler {_cell(progs['sampler'])}, evaluation "
                f"sampler {_cell(progs['eval_sampler'])},\ntrain step {_cell(progs['train_step'])}: {verdict}.\n")
    return render


BLOCKS["moe-v5p16-header"] = _header(PODS[0][0])
BLOCKS["moe-v5e64-header"] = _header(PODS[1][0])
BLOCKS["moe-pods"] = render_moe_pods
