"""A profile of a pipelined run: do the sampler's and the learner's programs run at the same time?

    python benchmarks/pipeline_trace.py --output benchmarks/results/pipeline/trace.json

Runs the peers workload (benchmarks/configs/peers.yaml) with the sampler on 4 of 8 emulated CPU
devices and the learner on the other 4, at staleness 0 and 1, traces steps 3 and 4 with
`jax.profiler` (a Perfetto trace beside the TensorBoard one), and reads the trace back: every XLA
op event names its program (`hlo_module`) and its device. Per run it reports each program's busy
time and devices, the time the sampler's devices were busy, the learner's, and both at once.
With k = 0 the two alternate; with k = 1 the learner's update should run inside the sampling.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from grpo_jax.config import load_config  # noqa: E402
from grpo_jax.trainer.loop import Trainer  # noqa: E402

OVERRIDES = ["train.steps=4", "eval.every=0", "checkpoint.every=0", "rollout.sampler_devices=4",
             "mesh={data: 4, fsdp: 1, tensor: 1}", "train.micro_batches=1", "train.shared_prompt=false",
             "eval.num_prompts=8"]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def busy(trace_file: str, sampler_devices: set[int]) -> dict:
    """Seconds each side's devices ran ops, and both at once, from a trace.json.gz."""
    events = json.load(gzip.open(trace_file))["traceEvents"]
    sides, modules = {"sampler": [], "learner": []}, {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_module" not in args or "device_ordinal" not in args:
            continue
        start, end = e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6
        device = int(args["device_ordinal"])
        side = "sampler" if device in sampler_devices else "learner"
        sides[side].append((start, end))
        m = modules.setdefault(args["hlo_module"], {"busy": [], "devices": set()})
        m["busy"].append((start, end))
        m["devices"].add(device)
    s, ll = union(sides["sampler"]), union(sides["learner"])
    return {"sampler_busy_s": length(s), "learner_busy_s": length(ll), "both_busy_s": length(intersect(s, ll)),
            "programs": {name: {"busy_s": round(length(union(m["busy"])), 4), "devices": sorted(m["devices"])}
                         for name, m in sorted(modules.items(), key=lambda kv: -length(union(kv[1]["busy"])))[:12]}}


def traced_run(staleness: int, work: Path) -> dict:
    config = load_config(ROOT / "benchmarks" / "configs" / "peers.yaml", [*OVERRIDES, f"rollout.staleness={staleness}"])
    out = work / f"trace_k{staleness}"

    def hook(step, metrics):
        if step == 2:
            jax.profiler.start_trace(str(out), create_perfetto_trace=True)
        if step == 4:
            jax.profiler.stop_trace()

    Trainer(config, work / f"run_k{staleness}", hooks=[hook], log=lambda line: None).run()
    trace = glob.glob(str(out / "plugins" / "profile" / "*" / "*.trace.json.gz"))[0]
    sampler = {d.id for d in sorted(jax.devices(), key=lambda d: d.id)[:4]}
    return {"staleness": staleness, **busy(trace, sampler)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        runs = [traced_run(k, Path(work)) for k in (0, 1)]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(runs, indent=1))
    for r in runs:
        print(f"k={r['staleness']}: sampler busy {r['sampler_busy_s']:.2f} s, learner busy {r['learner_busy_s']:.2f} s, "
              f"both at once {r['both_busy_s']:.2f} s (steps 3 and 4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
