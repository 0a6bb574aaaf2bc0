"""Pipelined runs (issue 29): the sampler on its own devices and bounded staleness, measured on this
machine, and a cost model that predicts a split pod's step time from per-phase times.

    python benchmarks/pipeline.py --output benchmarks/results/pipeline/demo [--steps 100]
    python benchmarks/pipeline.py --output benchmarks/results/pipeline/peers --steps 12 \
        --config benchmarks/configs/peers.yaml --set train.micro_batches=1 --set train.shared_prompt=false

Runs `grpo-jax train` on `configs/demo_cpu.yaml` (8 emulated CPU devices) at staleness k = 0, 1, 2,
with the devices shared (mesh data 8) and split 4 + 4 (rollout.sampler_devices 4, learner mesh data
4): every run samples the same number of batches of the same shape (equal sampled tokens up to
completion lengths). Writes `summary.json`: per run the median step time, the sampling and
update times, sampled tokens per second, the final held-out accuracy, `perf/weight_sync_s`; and
`cost_model.json`: the model below, fitted to the measured phases and applied to a v5e-16.

The cost model of one step, per phase times measured with all devices on one phase:
- shared devices: t_step = t_sample + t_update (+ rewards on the host);
- split, sampler on S of D devices, staleness k >= 1: the two run side by side, each slower by
  its lost devices: t_step = max(t_sample * D / S, t_update * D / (D - S)) + t_sync;
  with k = 0 they alternate: t_sample * D / S + t_update * D / (D - S) + t_sync.
Decode is memory-bound and scales less than linearly with devices (the decode scaling: the share of
the sampling time that scales with devices, the rest being per-token latency that does not; the
model is given for 1, 0.5 and 0.25); the update is compute-bound and scales linearly. Give a pod's
own measured phases with --pod-sample-s and --pod-update-s (default: this run's shared k = 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RUNS = {f"{layout}_k{k}": (layout, k) for layout in ("shared", "split") for k in (0, 1, 2)}


def run_one(name: str, layout: str, k: int, out: Path, steps: int, config: str = "configs/demo_cpu.yaml",
            extra: list[str] = ()) -> dict:
    over = [f"train.steps={steps}", "eval.every=0", "checkpoint.every=0", "train.progress=false",
            f"rollout.staleness={k}", *extra]
    over += ["rollout.sampler_devices=4", "mesh={data: 4, fsdp: 1, tensor: 1}"] if layout == "split" \
        else ["mesh={data: 8, fsdp: 1, tensor: 1}"]
    cmd = [sys.executable, "-m", "grpo_jax", "train", "--config", config, "--output", str(out / name)]
    for o in over:
        cmd += ["--set", o]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]

    def med(key):
        values = [r[key] for r in steps_[2:] if key in r]  # past the compiles
        return float(np.median(values)) if values else None

    return {"name": name, "layout": layout, "staleness": k, "wall_s": time.perf_counter() - t0,
            "step_s": med("perf/step_s"), "sample_s": med("perf/sample_s"), "ahead_s": med("perf/ahead_s"),
            "train_s": med("perf/train_s"), "weight_sync_s": med("perf/weight_sync_s"),
            "sample_tokens": float(sum(r["perf/sample_tokens"] for r in steps_)),
            "sample_tokens_per_s": float(sum(r["perf/sample_tokens"] for r in steps_))
            / float(sum(r["perf/step_s"] for r in steps_)),
            "accuracy_start": evals[0]["eval/accuracy"], "accuracy_end": evals[-1]["eval/accuracy"],
            "staleness_logged": sorted({r.get("rollout/staleness") for r in steps_} - {None})}


def predict(t_sample: float, t_update: float, t_sync: float, devices: int, sampler: int, k: int,
            decode_scaling: float) -> float:
    """The step time of a pod of `devices` with `sampler` of them sampling (0: shared), from the
    phases measured with all `devices` on each phase."""
    if sampler == 0:
        return t_sample + t_update
    scale = devices / sampler
    sample = t_sample * (decode_scaling * scale + (1 - decode_scaling))
    update = t_update * devices / (devices - sampler)
    return (max(sample, update) if k >= 1 else sample + update) + t_sync


def cost_model(t_sample: float, t_update: float, t_sync: float, *, devices: int) -> dict:
    """Predicted step times of a `devices`-chip pod, shared and split 4/8/12 chips sampling, k = 0
    and 1, for decode that scales with chips fully, half or a quarter; and the best choice."""
    table = {}
    for scaling in (1.0, 0.5, 0.25):
        rows = {"shared": t_sample + t_update}
        for sampler in (4, 8, 12):
            for k in (0, 1):
                rows[f"{sampler}_k{k}"] = predict(t_sample, t_update, t_sync, devices, sampler, k, scaling)
        best = min(rows, key=rows.get)
        table[str(scaling)] = {"step_s": rows, "best": best, "speedup": rows["shared"] / rows[best]}
    return {"devices": devices, "t_sample": t_sample, "t_update": t_update, "t_sync": t_sync, "by_decode_scaling": table}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--only", nargs="*", default=None, help="run names (default: all six)")
    ap.add_argument("--config", default="configs/demo_cpu.yaml", help="the workload (benchmarks/configs/peers.yaml: "
                    "the peers' whole-step workload)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more overrides for every run")
    ap.add_argument("--pod-sample-s", type=float, default=None, help="a pod's measured sampling time per step")
    ap.add_argument("--pod-update-s", type=float, default=None, help="a pod's measured update time per step")
    ap.add_argument("--pod-sync-s", type=float, default=0.05)
    args = ap.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.json"
    done = {r["name"]: r for r in json.loads(summary.read_text())} if summary.exists() else {}
    for name, (layout, k) in RUNS.items():
        if (args.only is None or name in args.only) and name not in done:
            done[name] = run_one(name, layout, k, out, args.steps, args.config, args.extra)
            summary.write_text(json.dumps(list(done.values()), indent=1))
            print(json.dumps(done[name]), flush=True)
    shared = done.get("shared_k0")
    if shared and args.pod_sample_s is None:
        args.pod_sample_s, args.pod_update_s = shared["sample_s"], shared["train_s"]
    if args.pod_sample_s is not None:
        model = cost_model(args.pod_sample_s, args.pod_update_s, args.pod_sync_s, devices=16)
        (out / "cost_model.json").write_text(json.dumps(model, indent=1))
        print(json.dumps({k: (v["best"], round(v["speedup"], 3)) for k, v in model["by_decode_scaling"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
