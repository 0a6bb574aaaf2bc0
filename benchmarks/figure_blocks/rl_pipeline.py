"""RL figures, pipelined runs: the sampler on its own devices and bounded staleness.

RESULTS.md's section "Pipelined runs" and the docs pages' "Rollouts on their own devices" (after its
`pipeline` block, which benchmarks/figures.py writes). The rest of the RL figures: figure_blocks/rl.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from figure_blocks import load
from figure_blocks.rl import _row, _span


def _pipeline(name: str) -> dict[str, dict]:
    """results/pipeline/NAME/summary.json: run name (shared_k0, split_k1, ...) -> its figures."""
    return {r["name"]: r for r in load(f"pipeline/{name}/summary.json")}


_COMMANDS = """\
```bash
python benchmarks/pipeline.py --output benchmarks/results/pipeline/demo --steps 100        # {demo} min
python benchmarks/pipeline.py --output benchmarks/results/pipeline/peers --steps 12 \\
  --config benchmarks/configs/peers.yaml --set train.micro_batches=1 --set train.shared_prompt=false   # {peers} min
```
"""


def render_pipeline_commands() -> str:
    """RESULTS.md "Pipelined runs": the commands, each with its runs' wall time summed and rounded up to a minute
    (results/pipeline/{demo,peers}/summary.json)."""
    total = {w: math.ceil(sum(r["wall_s"] for r in _pipeline(w).values()) / 60) for w in ("demo", "peers")}
    return _COMMANDS.format(**total)


def render_pipeline_table() -> str:
    """RESULTS.md "Pipelined runs": the step-time table, from results/pipeline/{peers,demo}/summary.json."""
    peers, demo = _pipeline("peers"), _pipeline("demo")
    label = lambda n, ks: f"{n.split('_')[0].replace('split', 'split 4 + 4,')} k = {ks}"  # noqa: E731
    vs = lambda runs, r: f"{runs['shared_k0']['step_s'] / r['step_s']:.2f}x"  # noqa: E731
    best = max(peers, key=lambda n: peers["shared_k0"]["step_s"] / peers[n]["step_s"])
    lines = ["| workload | run | step | sampling (during the update) | update (after the sampling) | weight copy | "
             "sampled tok/s | vs shared k = 0 |", "|---|---|---|---|---|---|---|---|"]
    for i, (name, r) in enumerate(peers.items()):
        copy = r["weight_sync_s"] and r["weight_sync_s"] * 1e3
        cells = [label(name, r["staleness"]), f"{r['step_s']:.2f} s", "", f"{r['train_s']:.2f} s",
                 "" if copy is None else f"{copy:.{1 if copy < 10 else 0}f} ms", f"{r['sample_tokens_per_s']:.0f}",
                 vs(peers, r)]
        cells[2] = f"{r['sample_s']:.2f} s" + (f" ({r['ahead_s']:.2f} s)" if r["staleness"] else "")
        if name == best:
            cells = [f"**{c}**" if j in (0, 1, 4, 6) else c for j, c in enumerate(cells)]
        lines.append(_row(["peers (64 rows x 128 tokens, 4-layer decoder)" if i == 0 else ""] + cells))
    base = demo["shared_k0"]
    lines.append(_row(["CPU demo (tiny model, 256 rows x 4 tokens)", "shared k = 0", f"{base['step_s']:.3f} s",
                       f"{base['sample_s']:.3f} s", f"{base['train_s']:.3f} s", "",
                       f"{base['sample_tokens_per_s']:.0f}", "1.00x"]))
    for layout in ("shared", "split"):
        runs = [r for n, r in demo.items() if n.startswith(layout) and (layout == "split" or r["staleness"])]
        join = lambda fmt, one=False: " / ".join(set(map(fmt, runs)) if one and len(set(map(fmt, runs))) == 1
                                                  else map(fmt, runs))  # noqa: E731
        lines.append(_row(["", label(layout, join(lambda r: str(r["staleness"]))),
                           join(lambda r: f"{r['step_s']:.3f}") + " s", "", "",
                           join(lambda r: f"{r['weight_sync_s'] * 1e3:.0f}", True) + " ms",
                           join(lambda r: f"{r['sample_tokens_per_s']:.0f}"), join(lambda r: vs(demo, r))]))
    return "\n".join(lines) + "\n"


_FINDINGS = """\
- **k = 1 with the 4 + 4 split runs {both_x:.2f}x the synchronous steps per second on the peers workload**
  (target: no slowdown, >= 0.95x). Part of that is not overlap: the split with k = 0 is already
  {split_x:.2f}x, because each phase runs on 4 emulated devices instead of 8 (less per-device overhead on
  2 cores). The overlap adds {s0:.2f} -> {s1:.2f} s ({overlap_x:.2f}x): with k = 1 the update's own wait after the
  sampling is {wait1:.2f} s, so it ran beside the sampling, which took {sample1:.2f} s instead of {sample0:.2f} s: the two
  share the same 2 cores, as the issue predicted. On shared devices k = 1 changes nothing ({sh0:.2f} vs
  {sh1:.2f} s): both phases queue on the same devices.
- **The weight copy is {copy:.0f} ms, {share:.1%} of the step** (target < 5%); {copy_shared:.0f} ms on shared devices with
  staleness (a copy there too: the learner donates its buffers while the sampler reads the older
  ones).
- **The profile** (`python benchmarks/pipeline_trace.py --output benchmarks/results/pipeline/trace.json`:
  steps 3 and 4 of the peers workload traced by `jax.profiler`, every XLA op event read back
  with its program and device): the sampler's devices were busy {sb0:.2f} s (k = 0) and {sb1:.2f} s (k = 1),
  the learner's {lb0:.2f} s and {lb1:.2f} s, **both at once {both} s in either run**. XLA:CPU runs one program
  at a time even on disjoint emulated devices: two jitted programs on devices 0-3 and 4-7, dispatched
  together, took the sum of their times, with no op of one inside the other (a check whose timings no
  result file keeps). So on this machine the programs of the two meshes cannot overlap; what k = 1
  overlapped is the sampler's host side (the Python loop of the engine between segments, decoding,
  scoring the rewards) with the learner's device time: the update's wait after the sampling fell
  from {wait0:.2f} s to {wait1:.2f} s. On TPUs and GPUs each device runs its own stream, and the same dispatch
  order lets the device programs overlap too; that is for a lent accelerator to show.
"""


def render_pipeline_findings() -> str:
    """RESULTS.md "Pipelined runs": "What these show", from results/pipeline/peers/summary.json and
    results/pipeline/trace.json (the profile)."""
    p = _pipeline("peers")
    sh0, sh1, s0, s1 = p["shared_k0"], p["shared_k1"], p["split_k0"], p["split_k1"]
    trace = {t["staleness"]: t for t in load("pipeline/trace.json")}
    return _FINDINGS.format(
        both_x=sh0["step_s"] / s1["step_s"], split_x=sh0["step_s"] / s0["step_s"], s0=s0["step_s"], s1=s1["step_s"],
        overlap_x=s0["step_s"] / s1["step_s"], wait0=s0["train_s"], wait1=s1["train_s"], sample0=s0["sample_s"],
        sample1=s1["sample_s"], sh0=sh0["step_s"], sh1=sh1["step_s"], copy=s1["weight_sync_s"] * 1e3,
        share=s1["weight_sync_s"] / s1["step_s"], copy_shared=sh1["weight_sync_s"] * 1e3,
        sb0=trace[0]["sampler_busy_s"], sb1=trace[1]["sampler_busy_s"], lb0=trace[0]["learner_busy_s"],
        lb1=trace[1]["learner_busy_s"], both=_span([t["both_busy_s"] for t in trace.values()]))


_LEARNING = """\
| split 4 + 4 | seed 0 | seed 1 | seed 2 | mean change from k = 0 |
|---|---|---|---|---|
| step 0 (the warm start) | {start} | |
| k = 0, step 100 | {k0} | |
| k = 1, step 100 | {k1} | **{d1:+.3f}** |
| k = 2, step 100 | {k2} | | | {d2:+.3f} (seed 0) |
| **k = 1 with `grpo.sampler_is_mask: [0.5, 2.0]`**, step 100 | {mask} | **{dmask:+.3f}** |

(`--set 'grpo.sampler_is_mask=[0.5, 2.0]'`; results/pipeline/demo_is_mask*.) On shared devices
(seed 0): {sh0:.3f} (k = 0), {sh1:.3f} (k = 1), {sh2:.3f} (k = 2).

**Without a correction, one step of staleness costs this demo {cost} of held-out accuracy at
equal sampled tokens, two steps most of what the run learns; with masked importance sampling
(tokens whose probability under the learner is below half or above twice the sampler's are
dropped from the policy term) k = 1 is within {within:.2f} of k = 0 on every seed** (target: within
0.05; met with the mask, not without). The demo learns fast (learning rate 1.5e-4 on a tiny model:
each update moves the policy far), so a batch one update old comes from a noticeably different
policy. A third of the learning rate also closes most of the gap without a correction (seed 0, lr
5e-5: {lr0:.3f} at k = 0, {lr1:.3f} at k = 1; results/pipeline/demo_lr5e-5), at a lower accuracy.
"""


def _staleness() -> dict[str, list[float]]:
    """The demo's held-out accuracy per seed (0, 1, 2) on the 4 + 4 split: at the start, after k = 0, 1, 2 (seed 0
    only) and k = 1 with the mask (results/pipeline/demo{,_seed1,_seed2}, demo_is_mask{,_s1,_s2})."""
    runs = [_pipeline(n) for n in ("demo", "demo_seed1", "demo_seed2")]
    masks = [_pipeline(n)["split_k1"] for n in ("demo_is_mask", "demo_is_mask_s1", "demo_is_mask_s2")]
    return {"start": [r["split_k0"]["accuracy_start"] for r in runs],
            **{f"k{k}": [r[f"split_k{k}"]["accuracy_end"] for r in runs if f"split_k{k}" in r] for k in (0, 1, 2)},
            "mask": [r["accuracy_end"] for r in masks]}


def render_pipeline_learning() -> str:
    """RESULTS.md "Pipelined runs": learning at equal sampled tokens (the table, shared devices, what staleness
    costs), from results/pipeline/demo*/summary.json."""
    a, shared, lr = _staleness(), _pipeline("demo"), _pipeline("demo_lr5e-5")
    cells = lambda xs: " | ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    change = lambda key: statistics.mean(x - y for x, y in zip(a[key], a["k0"]))  # noqa: E731
    return _LEARNING.format(
        **{k: cells(a[k]) for k in ("start", "k0", "k1", "k2", "mask")}, d1=change("k1"), d2=change("k2"),
        dmask=change("mask"), **{f"sh{k}": shared[f"shared_k{k}"]["accuracy_end"] for k in (0, 1, 2)},
        cost=_span([y - x for x, y in zip(a["k1"], a["k0"])]),
        within=math.ceil(100 * max(abs(x - y) for x, y in zip(a["mask"], a["k0"]))) / 100,
        lr0=lr["split_k0"]["accuracy_end"], lr1=lr["split_k1"]["accuracy_end"])


_COST = """\
**The cost model** (`benchmarks/pipeline.py`, `cost_model.json`): per step, shared devices cost
t_sample + t_update; with S of D chips sampling and k >= 1 the phases run side by side,
max(t_sample (a D/S + 1 - a), t_update D/(D - S)) + t_copy, where a is the share of decoding that
speeds up with chips (decode is bandwidth- and latency-bound; the update is compute-bound and
scales). Predicted step time of a v5e-{devices} relative to all {devices} chips shared, from the phases measured
here (peers: t_sample : t_update = {peers}) and for a decode-heavy run ({heavy}, long reasoning
completions):

| phases | decode scaling a | 4 sampling, k = 1 | 8 sampling, k = 1 | 12 sampling, k = 1 | best |
|---|---|---|---|---|---|
{rows}

(k = 0 never pays: the phases then alternate on fewer chips each.) A split pays only when decoding
gains little from more chips (small per-chip batches, latency-bound decode) and the side given
fewer chips still finishes within the other's time: then {best:.1f}x. When decode scales with chips, the
{devices} chips shared are faster for any split, and staleness buys nothing but the overlap of the host's
reward scoring. `configs/qwen3_0.6b_gsm8k_v5e16_split.yaml` is the 8 + 8 split for a decode-heavy
GSM8K run; measure a shared run's `perf/sample_s` and `perf/train_s` on the pod first and give them
to `--pod-sample-s/--pod-update-s`.
"""


def _cost_models() -> dict[str, dict]:
    return {name: load(f"pipeline/{name}/cost_model.json") for name in ("peers", "decode_heavy")}


def _phases(m: dict) -> str:
    """A cost model's t_sample : t_update, as "1.18 : 1.78" or "2 : 1"."""
    return " : ".join(f"{m[k]:.2f}".rstrip("0").rstrip(".") for k in ("t_sample", "t_update"))


def _best_speedup() -> float:
    return max(by["speedup"] for m in _cost_models().values() for by in m["by_decode_scaling"].values())


def render_pipeline_cost() -> str:
    """RESULTS.md "Pipelined runs": the cost model's predictions for a pod, from
    results/pipeline/{peers,decode_heavy}/cost_model.json."""
    models, rows = _cost_models(), []
    for name, m in models.items():
        for i, (a, by) in enumerate(m["by_decode_scaling"].items()):
            cells = [f"{by['step_s']['shared'] / by['step_s'][f'{s}_k1']:.2f}x" for s in (4, 8, 12)]
            cells = [f"**{c}**" if by["best"] == f"{s}_k1" else c for c, s in zip(cells, (4, 8, 12))]
            sampler = int(by["best"].split("_")[0]) if by["best"] != "shared" else 0
            best = f"{sampler} + {m['devices'] - sampler}, k = 1" if sampler else by["best"]
            rows.append(_row([f"{name.replace('_', '-')}, {_phases(m)}" if i == 0 else "", f"{float(a):g}", *cells,
                              best]))
    return _COST.format(devices=models["peers"]["devices"], peers=_phases(models["peers"]),
                        heavy=_phases(models["decode_heavy"]), rows="\n".join(rows), best=_best_speedup())


def render_readme_staleness() -> str:
    """docs/sampling.md "Rollouts on their own devices": what staleness cost the demo and what a split buys on a pod, from
    results/pipeline/demo*/summary.json and results/pipeline/{peers,decode_heavy}/cost_model.json."""
    a = _staleness()
    change = lambda key: statistics.mean(x - y for x, y in zip(a[key], a["k0"]))  # noqa: E731
    return ("What overlapped there is the sampler's host work\n"
            "(the engine's loop, decoding, rewards) with the learner's device time: XLA:CPU runs one program at\n"
            "a time, so a profile (`benchmarks/pipeline_trace.py`) shows the two meshes' programs never running\n"
            "at once on CPU; on TPUs and GPUs each device has its own stream. One step of staleness cost the CPU "
            f"demo {-change('k1'):.3f}\nheld-out accuracy at equal sampled tokens ({len(a['k1'])} seeds); with "
            "`grpo.sampler_is_mask: [0.5, 2.0]` it\ncost nothing "
            f"({change('mask'):+.3f}). `benchmarks/pipeline.py` also holds a cost model that predicts when a split\n"
            f"pays on a pod (only where decoding gains little from more chips: then about {_best_speedup():.1f}x on a v5e-16).\n")


BLOCKS: dict[str, Callable[[], str]] = {
    "rl-pipeline-commands": render_pipeline_commands,
    "rl-pipeline-table": render_pipeline_table,
    "rl-pipeline-findings": render_pipeline_findings,
    "rl-pipeline-learning": render_pipeline_learning,
    "rl-pipeline-cost": render_pipeline_cost,
    "rl-readme-staleness": render_readme_staleness,
}
