"""The critique of GRPO, measured (issue 46): one command per experiment, each writing its runs'
metrics (gzipped), a summary.json with the report's flags per run, and a plot under --output.

    python benchmarks/critique.py hacking   --output benchmarks/results/critique/hacking
    python benchmarks/critique.py overopt   --output benchmarks/results/critique/overopt
    python benchmarks/critique.py retention --output benchmarks/results/critique/retention_demo
    python benchmarks/critique.py retention --model smollm2 --output benchmarks/results/critique/retention_smollm2
    python benchmarks/critique.py credit    --output benchmarks/results/critique/credit

- hacking: the CPU demo (configs/demo_cpu.yaml, max_new_tokens 8 so there is room to hedge)
  trained on a deliberately weak verifier (benchmarks/critique_rewards.py: `answer_anywhere`, the
  gold digits anywhere in the text; `within_tolerance`, the last number within 2%) with the strict
  `math_accuracy` as eval.verifier, beside a control trained on the strict one. The gap is
  eval/accuracy (the weak judge) minus eval/verifier_accuracy (the strict one) at each evaluation.
- overopt: a reward model trained for --rm-steps by `grpo-jax train-rm` (configs/rm_demo_cpu.yaml)
  is the only training reward (the proxy); the strict verifier is the gold judge; one run per KL
  coefficient (grpo.beta) and seed. The over-optimisation curve is gold (eval/verifier_accuracy)
  against kl/k3 (the k3 estimate of KL(pi || pi_0) on the training batch, pi_0 the warm-started
  policy) at each evaluation.
- credit: configs/chain_cpu.yaml (a derivation of 8 running totals): GRPO, Dr. GRPO, PPO (a value
  head) and VAPO (a critic model, length-adaptive GAE, a positive-example LM loss), each critic's
  learning rate chosen from value warm-up runs (explained variance, and where it plateaus), each
  arm's policy learning rate from a sweep, then the arms over seeds and VAPO's parts taken out one
  at a time (`credit`'s docstring). --reward answer (the config's: the last total) or derivation
  (every total checked, so the first slip settles the outcome); --control: stage 1 on a reward the
  first token settles. benchmarks/credit_oracle.py says how much of the return any value could explain.
- retention: the run with and without its KL term (grpo.beta 0 vs --beta), eval.retention on:
  retention/kl and retention/general_nll on the shipped general corpus at each evaluation.

Every run is `grpo-jax train` with --set overrides, so `grpo-jax report RUN` reads it (after
gunzip). Wall times are this machine's (2 cores).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import stability  # noqa: E402
from grpo_jax.observe.health_checks import diagnose  # noqa: E402
from grpo_jax.observe.heldout_checks import kl_windows  # noqa: E402

REWARDS = "benchmarks/critique_rewards.py"
COMMON = ["checkpoint.every=0", "train.progress=false", "eval.retention=true", "eval.retention_top_k=64"]
MODELS = {"demo": "configs/demo_cpu.yaml", "smollm2": "configs/smollm2_135m_gsm8k_cpu.yaml",
          "gemma3": "configs/gemma3_270m_arith_cpu.yaml"}


PART = ("command", "commit", "date", "wall_s")  # what a summary says of each part of its runs


def train(run_dir: Path, config: str, sets: list[str], args) -> tuple[list[dict], float]:
    """One `grpo-jax train` run -> (its metrics records, wall seconds); its log beside it. A finished
    run of the same command is read back unless --fresh (stability.train_run)."""
    cmd = [args.python, "-m", "grpo_jax", "train", "--config", config, "--output", str(run_dir)]
    for s in [*COMMON, *sets]:
        cmd += ["--set", s]
    # (with_suffix would cut "beta0.01_s0" at its dot)
    return stability.train_run(run_dir, cmd, run_dir.parent / f"{run_dir.name}.log", reuse=not args.fresh)


def evals(records: list[dict], *keys: str) -> list[dict]:
    """Each evaluation's step and `keys` (with kl/k3 of the same step's update where logged), and
    `kl_window`: the mean kl/k3 of the updates since the previous evaluation (`kl_windows`, what the
    report's flag quotes too; one batch's k3 is noisy; the over-optimisation curve's x axis)."""
    windows = kl_windows(records)
    out = []
    for r in records:
        if "eval/accuracy" in r:
            own, strict = r.get("eval/accuracy"), r.get("eval/verifier_accuracy")
            out.append({"step": r["step"], **{k: r.get(k) for k in keys},
                        "kl_window": windows.get(r["step"], 0.0 if r["step"] == 0 else None),
                        "gap": None if strict is None else own - strict})  # the training judge over the second
    return out


def resummarise(output: Path) -> list[dict]:
    """The summary's runs again from their kept metrics (metrics.jsonl.gz), each with what it had."""
    earlier = json.loads((output / "summary.json").read_text())
    runs = []
    for r in earlier["runs"]:
        path = output / r["run"] / "metrics.jsonl.gz"
        if not path.exists():  # not a run (e.g. the credit stages' choices)
            runs.append(r)
            continue
        records = [json.loads(line) for line in gzip.open(path, "rt") if line.strip()]
        extra = {k: v for k, v in r.items() if k not in ("run", "wall_s", "evals", "flags", "flag_evidence")}
        runs.append(summary(r["run"], records, r["wall_s"], 128 * 4, **extra))
    return runs


def summary(name: str, records: list[dict], wall: float, eval_samples: int, **extra) -> dict:
    keys = ("eval/accuracy", "eval/verifier_accuracy", "eval/reward_mean", "eval/verifier_reward_mean",
            "health/verifier_disagreement", "kl/k3", "retention/kl", "retention/general_nll")
    flags = diagnose(records, eval_samples=eval_samples)
    return {"run": name, "wall_s": round(wall, 1), **extra, "evals": evals(records, *keys),
            "flags": [f.key for f in flags], "flag_evidence": {f.key: f.evidence for f in flags}}


def hacking(args) -> list[dict]:
    arms = {"strict": ["rewards=[{name: math_accuracy}]"],
            "anywhere": [f"rewards=[{{name: '{REWARDS}:answer_anywhere'}}]"],
            "tolerant": [f"rewards=[{{name: '{REWARDS}:within_tolerance', kwargs: {{tolerance: 0.02}}}}]"]}
    sets = ["sampling.max_new_tokens=8", "eval.verifier=math_accuracy", f"eval.every={args.eval_every}",
            f"train.steps={args.steps}"]
    out = []
    for arm, rewards in arms.items():
        for seed in args.seeds:
            name = f"{arm}_s{seed}"
            records, wall = train(args.output / name, MODELS["demo"], [*sets, *rewards, f"train.seed={seed}"], args)
            out.append(summary(name, records, wall, 128 * 4, arm=arm, seed=seed))
            print(json.dumps({k: out[-1][k] for k in ("run", "wall_s", "flags")}), flush=True)
    return out


def overopt(args) -> list[dict]:
    rm_dir = args.output / "rm"
    if not (rm_dir / "hf").exists():
        cmd = [args.python, "-m", "grpo_jax", "train-rm", "--config", "configs/rm_demo_cpu.yaml", "--output",
               str(rm_dir), "--set", f"train.steps={args.rm_steps}", "--set", "train.progress=false"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        (args.output / "rm.log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode:
            raise RuntimeError(f"train-rm failed; see {args.output / 'rm.log'}")
        (args.output / "rm_wall_s.txt").write_text(f"{time.perf_counter() - t0:.0f}\n")
    rm = (rm_dir / "hf").resolve()
    sets = [f"rewards=[{{name: reward_model, kwargs: {{path: {rm}, batch_size: 256}}}}]", "eval.reward=reward_model",
            "eval.verifier=math_accuracy", f"eval.every={args.eval_every}", f"train.steps={args.steps}"]
    out = []
    for beta in args.betas:
        for seed in args.seeds:
            name = f"beta{beta:g}_s{seed}"
            records, wall = train(args.output / name, MODELS["demo"], [*sets, f"grpo.beta={beta}",
                                                                        f"train.seed={seed}"], args)
            out.append(summary(name, records, wall, 128 * 4, beta=beta, seed=seed))
            print(json.dumps({k: out[-1][k] for k in ("run", "wall_s", "flags")}), flush=True)
    for junk in ("checkpoints", "tensorboard"):  # kept: rm/hf (--append reuses it; not committed), its metrics
        shutil.rmtree(rm_dir / junk, ignore_errors=True)
    return out


def retention(args) -> list[dict]:
    config = MODELS[args.model]
    sets = [f"eval.every={args.eval_every}"] + ([f"train.steps={args.steps}"] if args.steps else [])
    sets += [f"eval.num_prompts={args.eval_prompts}"] if args.eval_prompts else []
    out = []
    for beta in (0.0, args.beta):
        for seed in args.seeds:
            name = f"beta{beta:g}_s{seed}"
            records, wall = train(args.output / name, config, [*sets, f"grpo.beta={beta}", f"train.seed={seed}"], args)
            out.append(summary(name, records, wall, 128 * 4, beta=beta, seed=seed, model=args.model))
            print(json.dumps({k: out[-1][k] for k in ("run", "wall_s", "flags")}), flush=True)
    return out


# The credit-assignment comparison (configs/chain_cpu.yaml). Dr. GRPO's normaliser is the cap.
ARMS = {"grpo": [],
        "dr_grpo": ["grpo.advantage_scale=none", "grpo.loss_agg=seq_mean_token_sum_norm",
                    "grpo.max_completion_length=28"],
        "ppo": ["algorithm=ppo", "ppo.critic=head"],
        "vapo": ["algorithm=ppo", "ppo.critic=model", "ppo.length_adaptive_alpha=0.5", "ppo.positive_lm_coef=0.1"]}
# VAPO with one part taken out at a time (the warm-up is every critic arm's, --value-warmup steps).
ABLATIONS = {"vapo-no_positive_lm": ["ppo.positive_lm_coef=0"],
             "vapo-no_length_adaptive": ["ppo.length_adaptive_alpha=null"],
             "vapo-no_decoupled_gae": ["ppo.lam_critic=0.95"],
             "vapo-no_warmup": ["ppo.value_warmup_steps=0"],
             "vapo-head_critic": ["ppo.critic=head"]}


def _plateau(curve: list[float], window: int = 10, tol: float = 0.02) -> int | None:
    """The first step after which explained variance's `window`-step mean moves less than `tol`."""
    means = [float(np.mean(curve[i:i + window])) for i in range(0, len(curve) - window + 1, window)]
    for i in range(1, len(means)):
        if abs(means[i] - means[i - 1]) < tol:
            return i * window
    return None


def _reward(args) -> tuple[list[str], str]:
    """The credit runs' reward override and their names' prefix: the config's (the last total),
    `derivation_exact` (--reward derivation: every running total checked) or the control's."""
    name = "first_token_even" if args.control else {"answer": None, "derivation": "derivation_exact"}[args.reward]
    if name is None:
        return [], ""
    return reward_sets(name), "control_" if args.control else "derivation_"


def reward_sets(name: str) -> list[str]:
    """The --set that trains on benchmarks/critique_rewards.py's reward `name` alone."""
    return [f"rewards=[{{name: '{REWARDS}:{name}'}}]"]


def critic_warmups(args, config: str) -> tuple[list[dict], dict[str, float]]:
    """Stage 1: value warm-up runs alone (the policy held), one per critic kind and learning rate
    (a critic model's trunk at --trunk-lr-ratio x its head's) -> (their rows, each kind's best rate
    by explained variance over the last 10 steps). --control trains on `first_token_even` instead of
    the chain's reward: an outcome the first token settles, so a critic that reads it explains most
    of the return's variance after that token (a check that the critics can learn at all)."""
    out, critic_lr, warm = [], {}, args.value_warmup
    reward, prefix = _reward(args)
    for kind in args.critic_kinds:
        best = None
        for clr in args.critic_lrs:
            trunk = [] if kind == "head" or args.trunk_lr_ratio is None else \
                [f"ppo.critic_trunk_learning_rate={clr * args.trunk_lr_ratio:g}"]
            trunk += [f"ppo.critic_path={args.critic_path}"] if kind == "model" and args.critic_path else []
            name = f"{prefix}warmup_{kind}_clr{clr:g}"
            records, wall = train(args.output / name, config, [
                "algorithm=ppo", f"ppo.critic={kind}", f"ppo.value_warmup_steps={warm}", f"train.steps={warm}",
                f"ppo.critic_learning_rate={clr}", "eval.every=0", *trunk, *reward, *args.start], args)
            ev = [r["value/explained_variance"] for r in records if "value/explained_variance" in r]
            row = summary(name, records, wall, 128 * 4, stage="critic_lr", kind=kind, critic_lr=clr, ev_curve=ev,
                          ev_end=float(np.mean(ev[-10:])), ev_plateau_step=_plateau(ev), control=args.control,
                          critic_path=args.critic_path if kind == "model" else None,
                          trunk_lr=None if kind == "head" or args.trunk_lr_ratio is None else clr * args.trunk_lr_ratio)
            out.append(row)
            if getattr(args, "progress", None):
                args.progress(out)
            best = row if best is None or row["ev_end"] > best["ev_end"] else best
        critic_lr[kind] = best["critic_lr"]
    return out, critic_lr


def shared_warm_start(args, config: str) -> tuple[list[str], dict]:
    """--warm-start: the chain's supervised warm start, made once -> (the --set that start a run from
    it, what it is). A LoRA run of one step writes its warm-started base, before any adapter comes,
    to RUN/base (grpo_jax.trainer.lora_base), as an HF directory; every run then loads it
    (model.path) with no warm start of its own (sft.steps=0), so a run's seed varies only its RL."""
    run = args.output / f"warm_start_sft{args.warm_start}_s{args.warm_start_seed}"
    base = (run / "base").resolve()
    if not (base / "config.json").exists():  # (committed with the runs; one deleted is made again)
        (run / "run.json").unlink(missing_ok=True)
    records, wall = train(run, config, [f"sft.steps={args.warm_start}", f"train.seed={args.warm_start_seed}",
                                        "lora.rank=8", "train.steps=1", "eval.every=1", *_reward(args)[0]], args)
    first = next(r for r in records if "eval/accuracy" in r)
    about = {"sft_steps": args.warm_start, "seed": args.warm_start_seed, "accuracy": first["eval/accuracy"],
             "pass_at_k": first.get("eval/pass@k"), "wall_s": round(wall, 1)}
    print(json.dumps({"warm_start": about}), flush=True)
    return [f"model.path={base}", "model.architecture=null", "sft.steps=0"], about


def credit(args) -> list[dict]:
    """Four stages, each stage's choice read from the one before: (1) each critic kind's learning
    rate, from value warm-up runs alone (`critic_warmups`); (2) each arm's policy learning rate at
    seed 0 (final held-out accuracy); (3) the arms at their chosen rates over --seeds; (4) VAPO's
    parts taken out one at a time over --seeds. With --warm-start every run starts from one shared
    warm start (`shared_warm_start`); else each from its own seed's (the config's sft.steps)."""
    config, warm = "configs/chain_cpu.yaml", args.value_warmup
    args.start, start = shared_warm_start(args, config) if args.warm_start else ([], None)
    out, critic_lr = critic_warmups(args, config)
    if args.critic_only:  # stage 1 alone: where each critic's explained variance goes in warm-up
        return out + [{"run": "choices", "critic_lr": critic_lr, "warm_start": start, "evals": []}]
    crit = {"ppo": critic_lr["head"], "vapo": critic_lr["model"]}
    trunk = [] if args.trunk_lr_ratio is None else [f"ppo.critic_trunk_learning_rate={crit['vapo'] * args.trunk_lr_ratio:g}"]
    trunk += [f"ppo.critic_path={args.critic_path}"] if args.critic_path else []
    base = [f"eval.every={args.eval_every}", *_reward(args)[0], *args.start]

    def arm_sets(arm, lr, extra=()):
        """(the arm's settings, an ablation's `extra` last (it wins); its critic's warm-up steps). The
        warm-up comes on top of --steps (the policy makes --steps updates in every arm); a value head
        takes the rate stage 1 chose for heads, a critic model the model's, with its trunk rate and start."""
        kind, extra = arm.split("-")[0], list(extra)
        sets = [*base, *ARMS[kind], f"train.learning_rate={lr}"]
        if kind in crit:
            head = kind == "ppo" or "ppo.critic=head" in extra
            sets += [f"ppo.critic_learning_rate={crit['ppo' if head else 'vapo']}", f"ppo.value_warmup_steps={warm}"]
            sets += [] if head else trunk
        warmup = warm if kind in crit and "ppo.value_warmup_steps=0" not in extra else 0
        return [*sets, *extra, f"train.steps={args.steps + warmup}"], warmup

    def one(name, planned, seed, **extra):
        sets, warmup = planned  # arm_sets' pair
        records, wall = train(args.output / f"{name}_s{seed}", config, [*sets, f"train.seed={seed}"], args)
        evs = [r["value/explained_variance"] for r in records if "value/explained_variance" in r]
        out.append(summary(f"{name}_s{seed}", records, wall, 128 * 4, seed=seed, ev_curve=evs, warmup=warmup, **extra))
        print(json.dumps({k: out[-1][k] for k in ("run", "wall_s", "flags")}), flush=True)
        if args.progress:  # the summary so far: an interrupted comparison still shows its finished runs
            args.progress(out)
        return out[-1]["evals"][-1]["eval/accuracy"]

    policy_lr, swept = {}, {}
    for arm in ARMS:
        scores = {lr: one(f"{arm}_lr{lr:g}", arm_sets(arm, lr), 0, stage="policy_lr", arm=arm, lr=lr) for lr in args.lrs}
        swept.update({(arm, lr): row for lr, row in zip(args.lrs, out[-len(args.lrs):])})
        policy_lr[arm] = max(scores, key=scores.get)
    for arm in ARMS:
        for seed in args.seeds:
            if seed == 0:  # the sweep's run at the chosen rate is this seed's (the same command)
                out.append({**swept[(arm, policy_lr[arm])], "stage": "compare"})
                continue
            one(arm, arm_sets(arm, policy_lr[arm]), seed, stage="compare", arm=arm, lr=policy_lr[arm])
    for name, extra in ABLATIONS.items():
        for seed in args.seeds:
            one(name, arm_sets("vapo", policy_lr["vapo"], extra), seed, stage="ablate", arm=name, lr=policy_lr["vapo"])
    out.append({"run": "choices", "critic_lr": critic_lr, "policy_lr": policy_lr, "warm_start": start, "evals": []})
    return out


def _by_step(rows: list[dict], curve) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """steps, and the mean, min and max over `rows` of curve(row) -> {step: value} at each step."""
    at = defaultdict(list)
    for r in rows:
        for step, v in curve(r).items():
            at[step].append(v)
    steps = np.asarray(sorted(at), float)
    vals = [np.asarray(at[s], float) for s in sorted(at)]
    return steps, np.array([v.mean() for v in vals]), np.array([v.min() for v in vals]), np.array([v.max() for v in vals])


def plot_credit(runs: list[dict], path: Path) -> None:
    """The credit study in three panels: the critics' value warm-ups (stage 1, one line per critic
    and rate), then per arm (the comparison's and the ablations', mean of seeds, band min to max) the
    critic's explained variance and held-out accuracy against policy updates (a critic arm's
    warm-up steps taken off, so every arm starts at 0)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2), dpi=100, layout="constrained")
    warm, ev, acc = fig.subplots(1, 3)
    for r in runs:
        if r.get("stage") == "critic_lr" and r.get("ev_curve"):
            warm.plot(range(1, len(r["ev_curve"]) + 1), r["ev_curve"], label=f"{r['kind']} critic, rate {r['critic_lr']:g}")
    arms = defaultdict(dict)  # arm -> run name -> row (seed 0 of the comparison is a sweep run)
    for r in runs:
        if r.get("stage") in ("compare", "ablate"):
            arms[r["arm"]][r["run"]] = r
    # Each run's warm-up steps (recorded since the plot began; for older summaries of finished runs,
    # how many steps its arm ran past the arms that make only the policy's updates).
    last = {a: max((e["step"] for r in rows.values() for e in r["evals"]), default=0) for a, rows in arms.items()}
    updates = min(last.values(), default=0)
    warmup = lambda r: r["warmup"] if "warmup" in r else last[r["arm"]] - updates  # noqa: E731
    for i, (arm, rows) in enumerate(arms.items()):
        style = {"color": f"C{i % 10}", "linestyle": "--" if arm.startswith("vapo-") else "-", "label": arm}
        if any(r.get("ev_curve") for r in rows.values()):
            x, m, lo, hi = _by_step(list(rows.values()), lambda r: {t - warmup(r): v for t, v in
                                                                    enumerate(r.get("ev_curve") or [], 1)})
            ev.plot(x, m, **style)
            ev.fill_between(x, lo, hi, color=style["color"], alpha=0.1)
        x, m, lo, hi = _by_step(list(rows.values()), lambda r: {e["step"] - warmup(r): e["eval/accuracy"]
                                                                for e in r["evals"] if e.get("eval/accuracy") is not None})
        if len(x):
            acc.plot(x, m, marker="o", markersize=3, **style)
            acc.fill_between(x, lo, hi, color=style["color"], alpha=0.1)
    for ax, title, xlabel in ((warm, "value warm-up, policy held: explained variance", "warm-up step"),
                              (ev, "critic arms: explained variance (mean of seeds)", "policy update (< 0: warm-up)"),
                              (acc, "held-out accuracy (mean of seeds, band min-max)", "policy update (< 0: warm-up)")):
        ax.set(title=title, xlabel=xlabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    fig.savefig(path)


def plot(kind: str, runs: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    if kind == "credit":
        return plot_credit(runs, path)
    panels = {"hacking": [("step", "eval/accuracy", "weak judge (its own accuracy)"),
                          ("step", "eval/verifier_accuracy", "strict verifier accuracy"),
                          ("step", "gap", "gap: its own judge's accuracy - the strict one's")],
              "overopt": [("kl_window", "eval/verifier_accuracy", "gold (strict verifier) vs KL from pi_0"),
                          ("kl_window", "eval/reward_mean", "proxy (reward model, held-out) vs KL"),
                          ("step", "retention/kl", "retention/kl")],
              "retention": [("step", "retention/kl", "retention/kl (nats/token)"),
                            ("step", "retention/general_nll", "retention/general_nll"),
                            ("step", "eval/accuracy", "held-out accuracy")]}[kind]
    fig = Figure(figsize=(15, 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(panels))
    runs = list({r["run"]: r for r in runs if r["run"] != "choices"}.values())  # seed 0 of compare is a sweep run
    groups = list(dict.fromkeys(r["run"].rsplit("_s", 1)[0] for r in runs))
    colors = {g: f"C{i % 10}" for i, g in enumerate(groups)}  # matplotlib's ten-colour cycle
    for ax, (x, y, title) in zip(axes, panels):
        for r in runs:
            group = r["run"].rsplit("_s", 1)[0]
            pts = [(e[x], e[y]) for e in r["evals"] if e.get(x) is not None and e.get(y) is not None]
            if pts:
                xs, ys = np.asarray(pts, float).T
                first = r["run"] == next(q["run"] for q in runs if q["run"].rsplit("_s", 1)[0] == group)
                ax.plot(xs, ys, marker="o", markersize=3, alpha=0.8, color=colors[group], label=group if first else None)
        ax.set(title=title, xlabel="kl/k3 (mean over the updates since the last evaluation)" if x == "kl_window" else x)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="x-small")
    fig.savefig(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=["hacking", "overopt", "retention", "credit"])
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: hacking/overopt 300, credit 200 policy updates (a critic's warm-up "
                   "on top), retention the config's)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--betas", type=float, nargs="+", default=[0.001, 0.01, 0.1], help="overopt: grpo.beta per arm")
    p.add_argument("--rm-steps", type=int, default=600, help="overopt: the proxy reward model's training steps")
    p.add_argument("--model", choices=sorted(MODELS), default="demo", help="retention: which run")
    p.add_argument("--beta", type=float, default=0.04, help="retention: the KL coefficient of the run with one")
    p.add_argument("--eval-prompts", type=int, default=None, help="retention: eval.num_prompts")
    p.add_argument("--lrs", type=float, nargs="+", default=[5e-5, 1.5e-4, 4.5e-4], help="credit: policy learning rates")
    p.add_argument("--critic-lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3], help="credit: critic learning rates")
    p.add_argument("--value-warmup", type=int, default=100, help="credit: the critics' value warm-up steps")
    p.add_argument("--critic-only", action="store_true", help="credit: stage 1 alone (the critics' warm-up runs)")
    p.add_argument("--critic-kinds", nargs="+", choices=["head", "model"], default=["head", "model"],
                   help="credit: the critics stage 1 warms up")
    p.add_argument("--trunk-lr-ratio", type=float, default=None,
                   help="credit: a critic model's trunk learning rate over its head's (default: the same rate)")
    p.add_argument("--reward", choices=["answer", "derivation"], default="answer",
                   help="credit: the chain config's reward on the last total, or every running total checked")
    p.add_argument("--critic-path", default=None,
                   help="credit: the critic model's starting weights (ppo.critic_path: a reward model's HF directory)")
    p.add_argument("--control", action="store_true",
                   help="credit: stage 1 on the control reward `first_token_even` (implies --critic-only)")
    p.add_argument("--warm-start", type=int, default=None, metavar="SFT_STEPS",
                   help="credit: every run starts from one warm start (SFT_STEPS supervised steps at --warm-start-seed), "
                        "made once, instead of its own seed's (the config's sft.steps)")
    p.add_argument("--warm-start-seed", type=int, default=0, help="credit: the shared warm start's seed")
    p.add_argument("--append", action="store_true",
                   help="keep the runs already in --output's summary.json (a run of the same name is replaced)")
    p.add_argument("--fresh", action="store_true",
                   help="run every run again (by default a finished run of the same command in --output is read back)")
    p.add_argument("--summarise-only", action="store_true",
                   help="summarise and plot the runs already in --output again (from their metrics), running nothing")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    if args.summarise_only:
        summary_file = args.output / "summary.json"
        result = json.loads(summary_file.read_text())
        result["runs"] = resummarise(args.output)
        plot(args.experiment, result["runs"], args.output / f"{args.experiment}.png")
        save(summary_file, result)
        return 0
    if args.critic_path and "model" not in args.critic_kinds:
        p.error("--critic-path starts the critic model: add model to --critic-kinds")
    if args.control and args.reward != "answer":
        p.error("--control trains on its own reward: leave --reward out")
    args.critic_only = args.critic_only or args.control
    if args.experiment == "credit" and not args.critic_only and set(args.critic_kinds) != {"head", "model"}:
        p.error("credit's comparison needs both critic kinds (--critic-kinds head model), or --critic-only")
    if args.steps is None and args.experiment != "retention":
        args.steps = 200 if args.experiment == "credit" else 300
    args.output.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # The code the runs use: the commit at the start (the runs read the working tree as it is then).
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    summary_file = args.output / "summary.json"
    head = {"experiment": args.experiment, "command": " ".join(["python", "benchmarks/critique.py", *(argv or sys.argv[1:])]),
            "commit": commit.strip(), "date": time.strftime("%Y-%m-%d"), "machine": "this project's 2-core CPU machine"}
    # Resuming the same command's unfinished summary: its parts (command, commit, date, time) go on.
    try:  # (a summary cut short is a fresh start)
        before = json.loads(summary_file.read_text()) if not (args.append or args.fresh) else {}
    except (OSError, json.JSONDecodeError):
        before = {}
    prior = (before.get("parts") or [{k: before[k] for k in PART}]) if before.get("finished") is False and \
        before["command"] == head["command"] else []

    def parted(**extra) -> dict:  # the summary's head: this part's time, on top of the parts before it
        now = round(time.perf_counter() - t0)
        parts = [*prior, {**{k: head[k] for k in PART[:3]}, "wall_s": now}] if prior else None
        return {**head, **extra, "wall_s": sum(p["wall_s"] for p in prior) + now, **({"parts": parts} if parts else {})}

    args.progress = None if args.append else lambda runs: save(summary_file, {**parted(finished=False), "runs": runs})
    runs = {"hacking": hacking, "overopt": overopt, "retention": retention, "credit": credit}[args.experiment](args)
    earlier = json.loads(summary_file.read_text()) if args.append and summary_file.exists() else None
    if earlier is not None:  # more seeds for the same experiment: one summary, each part's command and commit
        names = {r["run"] for r in runs}
        runs = [r for r in earlier["runs"] if r["run"] not in names] + runs
    plot(args.experiment, runs, args.output / f"{args.experiment}.png")
    result = {**parted(), "runs": runs}
    if earlier is not None:
        result["parts"] = earlier.get("parts", [{k: earlier[k] for k in PART}])
        result["parts"].append({k: result[k] for k in PART})
        result["wall_s"] = sum(part["wall_s"] for part in result["parts"])
    save(summary_file, result)
    return 0


def save(path: Path, summary: dict) -> None:
    """Whole or not at all: a run killed while saving leaves the summary before it."""
    part = path.with_suffix(".json.part")
    part.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(part, path)


if __name__ == "__main__":
    raise SystemExit(main())
