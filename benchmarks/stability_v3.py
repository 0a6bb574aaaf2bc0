"""Stability study, third edition (issue 46): GRPO and its relatives on the CPU demo task with
enough power to say which differences are real.

    python benchmarks/stability_v3.py --output benchmarks/results/stability_v3

About 80 runs of ~90 s on 2 cores (2 h). A run finished earlier in --output with the same settings
is read back, not run again: an interrupted study goes on where it stopped (--fresh: run all).

What changed from the second edition (benchmarks/stability.md):
- The data: 2-digit addition with `commutative_twins: false` (arithmetic's option), so no held-out
  sum has its twin (b + a) in training; 3,500 train / 500 held-out problems (the 4,095 unordered
  pairs hold no more). Stage 0 reads both splits and counts the held-out problems whose operand
  pair (either order) or whose exact question is in training: both must be 0.
- Critics tuned: each critic kind's learning rate is chosen from value warm-up runs alone (the
  explained variance over the warm-up's last 10 steps), stage 1.
- Each arm's policy learning rate is swept (--lrs, over --sweep-seeds) before the comparison, stage 2
  (the random-reward control takes GRPO's).
- At least 6 seeds per arm at its chosen rate (the sweep's runs at that rate are reused), stage 3;
  the spurious-reward control and RLOO are in; DAPO (dynamic sampling samples more per step) is
  compared at GRPO's sampled-token budget, evaluating every 10 steps for the resolution.
- Stage 4: each arm's final held-out accuracy with its 95% t interval, and each arm against GRPO
  paired by seed (the same seed: the same warm start and prompt order) with the interval of the
  difference, the exact sign-flip test's p and Holm's correction over the family
  (benchmarks/paired_stats.py). Every run's metrics are kept (gzipped) beside summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
import paired_stats  # noqa: E402
import stability  # noqa: E402

DATA = ("data.builder_kwargs={ops: ['+'], formats: ['{a}{op}{b}='], num_train: 3500, num_test: 500, "
        "commutative_twins: false}")
ARMS = ["grpo", "dr_grpo", "rloo", "cispo", "dapo", "ppo", "vapo", "grpo_random"]
CRITICS = {"ppo": "head", "vapo": "model"}


def leak_check(data_dir: str) -> dict:
    """Held-out problems whose operand pair (either order) or exact question is in training, for
    this edition's data and for the second edition's (twins allowed), read from the built splits."""
    from grpo_jax.data import load_source

    out = {}
    for name, twins, n_train in (("v3", False, 3500), ("v2", True, 7500)):
        def split(s):
            src = load_source("arithmetic", s, data_dir=data_dir, builder_config="small", ops=["+"],
                              formats=["{a}{op}{b}="], num_train=n_train, num_test=500, commutative_twins=twins)
            return [src[i]["question"] for i in range(len(src))]

        train, test = split("train"), split("test")
        pair = lambda q: tuple(sorted(q.rstrip("=").split("+")))  # noqa: E731
        pairs = {pair(q) for q in train}
        out[name] = {"train": len(train), "test": len(test), "test_twin_in_train": sum(pair(q) in pairs for q in test),
                     "test_question_in_train": len(set(test) & set(train))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/stability_v3")
    p.add_argument("--arms", nargs="+", default=ARMS, choices=list(stability.VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4, 5])
    p.add_argument("--sweep-seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--lrs", nargs="+", type=float, default=[5e-5, 1.5e-4, 4.5e-4])
    p.add_argument("--critic-lrs", nargs="+", type=float, default=[3e-4, 1e-3, 3e-3])
    p.add_argument("--value-warmup", type=int, default=50)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--fresh", action="store_true",
                   help="run every run again (default: a run already finished in --output with the same settings is reused)")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    out, t0 = args.output, time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    config = ROOT / "configs/demo_cpu.yaml"
    result = {"command": " ".join(["python", "benchmarks/stability_v3.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "leaks": leak_check(str(ROOT / "data/tfds"))}
    assert result["leaks"]["v3"]["test_twin_in_train"] == result["leaks"]["v3"]["test_question_in_train"] == 0

    def run(variant, seed, where, extra):
        (out / where).mkdir(parents=True, exist_ok=True)
        return stability.run_one(variant, seed, out / where, args.steps, args.python, config=config,
                                 value_warmup=args.value_warmup, extra=(DATA, *extra), reuse=not args.fresh)

    critic_lr = {}
    for arm, kind in CRITICS.items():  # stage 1: warm-up alone, the critic's explained variance
        if arm not in args.arms:
            continue
        ends = {}
        # the policy held for the whole run: PPO's arm has no warm-up of its own, so it gets one here
        warm = [] if "{value_warmup}" in " ".join(stability.VARIANTS[arm]) else [f"ppo.value_warmup_steps={args.value_warmup}"]
        for clr in args.critic_lrs:
            (out / "critic_lr" / f"clr{clr:g}").mkdir(parents=True, exist_ok=True)
            r = stability.run_one(arm, 0, out / "critic_lr" / f"clr{clr:g}", args.value_warmup, args.python, config=config,
                                  value_warmup=args.value_warmup,
                                  extra=(DATA, f"ppo.critic_learning_rate={clr}", "eval.every=0", *warm), reuse=not args.fresh)
            ends[clr] = r["explained_variance_warmup_end"]
            if not np.isfinite(ends[clr]):
                raise RuntimeError(f"{arm}'s critic at {clr:g}: no warm-up step logged value/explained_variance")
        critic_lr[arm] = max(ends, key=ends.get)
        result.setdefault("critic_lr_sweep", {})[arm] = {f"{k:g}": v for k, v in ends.items()}
    result["critic_lr"] = critic_lr

    def sets(arm, lr):
        extra = [f"train.learning_rate={lr}"] + ([f"ppo.critic_learning_rate={critic_lr[arm]}"] if arm in critic_lr else [])
        return extra + (["eval.every=10"] if arm == "dapo" else [])

    runs, policy_lr = [], {}
    for arm in [a for a in args.arms if a != "grpo_random"]:  # stage 2
        finals = {}
        for lr in args.lrs:
            got = [run(arm, s, f"lr{lr:g}", sets(arm, lr)) for s in args.sweep_seeds]
            finals[lr] = float(np.mean([g["eval_final"] for g in got]))
            runs += [{**g, "lr": lr, "stage": "sweep"} for g in got]
        policy_lr[arm] = max(finals, key=finals.get)
        result.setdefault("lr_sweep", {})[arm] = {f"{k:g}": v for k, v in finals.items()}
    policy_lr["grpo_random"] = policy_lr.get("grpo", args.lrs[1])
    result["policy_lr"] = policy_lr
    for arm in args.arms:  # stage 3
        for s in args.seeds:
            if not any(r["variant"] == arm and r["seed"] == s and r["lr"] == policy_lr[arm] for r in runs):
                runs.append({**run(arm, s, f"lr{policy_lr[arm]:g}", sets(arm, policy_lr[arm])),
                             "lr": policy_lr[arm], "stage": "compare"})
    chosen = [r for r in runs if r["lr"] == policy_lr[r["variant"]] and r["seed"] in args.seeds]
    result["stats"] = compare(chosen)
    result["runs"] = runs
    result["wall_s"] = round(time.perf_counter() - t0)
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def compare(runs: list[dict]) -> dict:
    """Stage 4: per arm, the final accuracy's mean and 95% t interval; each arm against GRPO paired
    by seed (DAPO at GRPO's mean sampled-token budget), Holm-adjusted over the family."""
    by = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    budget = float(np.mean([r["sampled_tokens"] for r in by.get("grpo", {}).values()])) if "grpo" in by else None

    def score(arm, r):
        if arm == "dapo" and budget is not None:  # the last evaluation within GRPO's token budget
            return [acc for _, t, acc in r["eval_tokens_curve"] if t <= 1.01 * budget][-1]
        return r["eval_final"]

    scores = {arm: {s: score(arm, r) for s, r in rs.items()} for arm, rs in by.items()}
    out = {"token_budget": budget, "arms": {a: paired_stats.mean_ci(list(v.values())) for a, v in scores.items()}}
    if "grpo" in scores:
        tests = {a: paired_stats.paired(scores[a], scores["grpo"]) for a in scores if a != "grpo"}
        adjusted = paired_stats.holm({a: t["p"] for a, t in tests.items()})
        out["vs_grpo"] = {a: {**t, "p_holm": adjusted[a], "real": adjusted[a] <= 0.05 and (t["lo"] > 0 or t["hi"] < 0)}
                          for a, t in tests.items()}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
