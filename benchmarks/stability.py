"""Stability lab: GRPO and its relatives (DAPO, Dr. GRPO, RLOO, CISPO) against critic-based PPO
and VAPO on the CPU demo task, several seeds each.

    python benchmarks/stability.py --output benchmarks/results/stability_v2   # the second edition
    python benchmarks/stability.py --variants grpo dr_grpo rloo ppo grpo_random \
        --output benchmarks/results/stability                                   # the first

Each (variant, seed) is one `grpo-jax train --config configs/demo_cpu.yaml` run with the variant's
`--set` overrides and `train.seed`. Every run samples the same prompts per step, G and
max_new_tokens for the same number of steps (equal sampled tokens up to completion lengths, which
the summary reports), with train.micro_batches: 4 so the gradient noise scale is measured. Only
config.yaml, samples.jsonl and metrics.jsonl (gzipped: `grpo-jax report`
and `read_metrics` want it unzipped) of each run are kept. Writes `summary.json` (per run and
per variant: final held-out accuracy mean and spread, gradient noise scale, dead-group fraction,
sampled tokens, wall time) and `stability.png`; `benchmarks/stability.md` reports them.
"""

from __future__ import annotations

import argparse
import hashlib
import gzip
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["train.micro_batches=4", "checkpoint.every=0", "train.progress=false"]
VARIANTS = {
    "grpo": [],  # the demo: group mean and std, token-mean loss, clip-higher, beta 0.01
    "dr_grpo": ["grpo.advantage_scale=none", "grpo.loss_agg=seq_mean_token_sum_norm",
                "grpo.max_completion_length={max_new_tokens}"],
    "rloo": ["grpo.advantage_estimator=rloo", "grpo.advantage_scale=none"],
    "ppo": ["algorithm=ppo", "ppo.critic_learning_rate=0.001"],
    # DAPO: the demo's clip-higher and token mean, plus dynamic sampling (resampling groups whose
    # rewards do not vary: it samples more tokens per step, see sampled_tokens and eval_at_tokens).
    "dapo": ["train.dynamic_sampling=true"],
    "cispo": ["grpo.policy_loss=cispo"],  # MiniMax-M1's clipped-weight REINFORCE, bound 5.0
    # At mu = 1 every ratio is 1: CISPO's gradient is GRPO's. Two updates per batch (mu = 2) are
    # where the two differ (the second update's ratios move off 1, clipped by GRPO, not by CISPO).
    "grpo_mu2": ["grpo.num_iterations=2"],
    "cispo_mu2": ["grpo.policy_loss=cispo", "grpo.num_iterations=2"],
    # VAPO: a separate critic (the warm-started policy's copy with a zero head), 50 critic-only steps
    # on Monte-Carlo returns, decoupled GAE (critic 1.0, policy length-adaptive), a positive-example
    # LM loss. alpha 5, not VAPO's 0.05: completions here are 1-4 tokens, and 1 - 1/(0.05 l) < 0
    # would make lambda 0 on every row; 5 gives 0.8 at 1 token and 0.95 at 4.
    "vapo": ["algorithm=ppo", "ppo.critic=model", "ppo.value_warmup_steps={value_warmup}", "ppo.length_adaptive_alpha=5",
             "ppo.positive_lm_coef=0.1", "ppo.critic_learning_rate=0.001"],
    # VAPO as its paper runs it: the critic initialised from a trained reward model (--critic-path,
    # e.g. `grpo-jax train-rm --config configs/rm_demo_cpu.yaml`'s hf/ directory: 4 layers, its score
    # head as the value head), then the same warm-up and losses.
    "vapo_rm": ["algorithm=ppo", "ppo.critic=model", "ppo.critic_path={critic_path}",
                "ppo.value_warmup_steps={value_warmup}", "ppo.length_adaptive_alpha=5", "ppo.positive_lm_coef=0.1",
                "ppo.critic_learning_rate=0.001"],
    # The spurious-reward control: GRPO learning from coin flips with the batch's mean reward.
    "grpo_random": ["reward_control=random"],
}


SECOND_EDITION = ["grpo", "dapo", "dr_grpo", "cispo", "ppo", "vapo"]


def run_one(variant: str, seed: int, out: Path, steps: int | None, python: str, *, config: Path,
            value_warmup: int = 50, critic_path: str | None = None, extra: tuple[str, ...] = (),
            reuse: bool = False) -> dict:
    """One run's summary. `reuse`: a finished run of the same command in `out` (its run.json) is
    read back instead of run again, so a long study interrupted part way goes on where it stopped."""
    run_dir = out / f"{variant}_s{seed}"
    fill = {"max_new_tokens": yaml.safe_load(config.read_text())["sampling"]["max_new_tokens"],
            "value_warmup": value_warmup, "critic_path": critic_path}
    if "{critic_path}" in " ".join(VARIANTS[variant]) and critic_path is None:
        raise SystemExit(f"{variant} needs --critic-path (a reward model's HF directory)")
    sets = [*COMMON, *(v.format(**fill) for v in VARIANTS[variant]), *extra, f"train.seed={seed}"]
    sets += [f"train.steps={steps}"] if steps else []
    cmd = [python, "-m", "grpo_jax", "train", "--config", str(config), "--output", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    records, wall = train_run(run_dir, cmd, out / f"{variant}_s{seed}.log", reuse=reuse)
    return summarise(variant, seed, records, wall)


def train_run(run_dir: Path, cmd: list[str], log: Path, *, reuse: bool = False) -> tuple[list[dict], float]:
    """`cmd` (a `grpo-jax train` whose --output is run_dir) -> (its metrics records, wall seconds);
    its command and output in `log`, the run kept small (`compact`). With `reuse`, a finished run
    of the same command (its run.json; the interpreter's and the run's paths aside) is read back
    instead, so a long study interrupted part way goes on where it stopped."""
    done, key, inputs = run_dir / "run.json", _portable(cmd[1:]), _inputs(cmd)
    if reuse and done.exists():
        kept = json.loads(done.read_text())
        if _portable(kept["cmd"], output=False) == key and kept.get("inputs") == inputs:
            records = [json.loads(line) for line in gzip.open(run_dir / "metrics.jsonl.gz", "rt") if line.strip()]
            return records, kept["wall_s"]
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"{run_dir.name} failed (exit {proc.returncode}); see {log}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    compact(run_dir)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    done.write_text(json.dumps({"cmd": key, "inputs": inputs, "commit": commit, "wall_s": wall}) + "\n")
    return records, wall


def _portable(args: list[str], output: bool = True) -> list[str]:
    """A run's command as run.json compares it: --output's value dropped (`output`: it is still
    there) and the checkout's path cut from the rest, so a study cloned elsewhere reads its
    finished runs back."""
    root = str(ROOT) + "/"
    drop = args.index("--output") + 1 if output and "--output" in args else -1
    return [a.replace(root, "") for i, a in enumerate(args) if i != drop]


def _inputs(cmd: list[str]) -> dict[str, str | None]:
    """The files a run reads besides the library: its --config and the user code a --set names
    (`path.py:function`), each by a hash of its content (a YAML file's settings, not its comments;
    None: not there), so a run whose config or reward file changed since is run again, not read back."""
    names = {cmd[cmd.index("--config") + 1]} if "--config" in cmd else set()
    names |= set(re.findall(r"([\w./-]+\.py):\w", " ".join(cmd)))
    out = {}
    for name in sorted(names):
        path = Path(name) if Path(name).is_absolute() else ROOT / name
        if not path.exists():
            out[name.replace(str(ROOT) + "/", "")] = None
            continue
        text = path.read_bytes()
        if path.suffix in (".yaml", ".yml"):
            text = json.dumps(yaml.safe_load(text), sort_keys=True).encode()
        out[name.replace(str(ROOT) + "/", "")] = hashlib.sha256(text).hexdigest()[:16]
    return out


def compact(run_dir: Path) -> None:
    """Keep what the summary and a later look need, small enough to commit."""
    for junk in ("checkpoints", "tensorboard", "model"):
        shutil.rmtree(run_dir / junk, ignore_errors=True)
    for junk in ("metrics.png", "report.html", "retention_reference.npz"):  # (pi_0's top-k: a resume's cache)
        (run_dir / junk).unlink(missing_ok=True)
    metrics = run_dir / "metrics.jsonl"
    with gzip.open(run_dir / "metrics.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(metrics.read_text())
    metrics.unlink()


def _mean(records, key, start=0):
    vals = [r[key] for r in records if r.get(key) is not None and r["step"] > start and key in r]
    return float(np.mean(vals)) if vals else float("nan")


def summarise(variant: str, seed: int, records: list[dict], wall_s: float) -> dict:
    evals = [r for r in records if "eval/accuracy" in r]
    train = [r for r in records if "reward/mean" in r]
    return {
        "variant": variant, "seed": seed, "wall_s": wall_s,
        "eval_start": evals[0]["eval/accuracy"], "eval_final": evals[-1]["eval/accuracy"],
        "pass_final": evals[-1]["eval/pass@k"],
        "eval_curve": [(r["step"], r["eval/accuracy"]) for r in evals],
        "sampled_tokens": float(sum(r.get("perf/sample_tokens", 0.0) for r in train)),
        "grad_noise_scale": _mean(train, "health/grad_noise_scale"),
        "grad_noise_curve": [(r["step"], r.get("health/grad_noise_scale")) for r in train],
        "frac_zero_std": _mean(train, "groups/frac_zero_std"),
        "frac_zero_std_expected": _mean(train, "health/frac_zero_std_expected"),
        "frac_zero_std_late": _mean(train, "groups/frac_zero_std", start=len(train) // 2),
        "entropy_late": _mean(train, "policy/entropy", start=len(train) // 2),
        "explained_variance_late": _mean(train, "value/explained_variance", start=len(train) // 2),
        "explained_variance_curve": [(r["step"], r.get("value/explained_variance")) for r in train
                                     if "value/explained_variance" in r],
        # The critic after its value warm-up (VAPO): the mean over the warm-up's last 10 steps.
        "explained_variance_warmup_end": _warmup_end(train),
        # Held-out accuracy at equal sampled tokens: the last evaluation within the token budget of
        # a run that samples each step's batch once (DAPO's resampling spends more per step).
        "eval_tokens_curve": _eval_tokens(records),
        "train_s": float(sum(r.get("perf/step_s", 0.0) for r in train)),
        # Instability, if any: the largest fall of held-out accuracy from one evaluation to any
        # later one, the largest KL to the reference and gradient norm of a step, skipped updates.
        "eval_max_drop": max([a["eval/accuracy"] - b["eval/accuracy"] for i, a in enumerate(evals)
                              for b in evals[i + 1:]] + [0.0]),
        "kl_max": max([r.get("kl/k3", 0.0) for r in train] + [0.0]),
        "grad_norm_max": max([r.get("train/grad_norm", 0.0) for r in train] + [0.0]),
        "skipped_steps": max([r.get("train/skipped_steps", 0.0) for r in train] + [0.0]),
    }


def _warmup_end(train: list[dict]) -> float:
    warm = [r["value/explained_variance"] for r in train if r.get("value/warmup") == 1.0]
    return float(np.nanmean(warm[-10:])) if warm else float("nan")


def _eval_tokens(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, sampled tokens so far, held-out accuracy) at each evaluation."""
    tokens, out = 0.0, []
    for r in records:
        tokens += r.get("perf/sample_tokens", 0.0)
        if "eval/accuracy" in r:
            out.append((r["step"], tokens, r["eval/accuracy"]))
    return out


def at_equal_tokens(runs: list[dict]) -> None:
    """Each run's `eval_at_tokens`: its accuracy at the last evaluation whose sampled tokens are
    within the smallest final budget of all runs (+1%)."""
    budget = 1.01 * min(r["sampled_tokens"] for r in runs)
    for r in runs:
        r["eval_at_tokens"] = [acc for _, t, acc in r["eval_tokens_curve"] if t <= budget][-1]


def aggregate(runs: list[dict]) -> dict:
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        rs = [r for r in runs if r["variant"] == variant]
        agg = {"seeds": [r["seed"] for r in rs]}
        for key in ("eval_final", "eval_at_tokens", "pass_final", "grad_noise_scale", "frac_zero_std",
                    "frac_zero_std_expected", "frac_zero_std_late", "entropy_late", "explained_variance_late",
                    "explained_variance_warmup_end", "sampled_tokens", "wall_s", "train_s", "eval_max_drop",
                    "kl_max", "grad_norm_max", "skipped_steps"):
            vals = np.asarray([r.get(key, np.nan) for r in rs], float)
            agg[key] = {"mean": float(np.mean(vals)), "min": float(np.min(vals)), "max": float(np.max(vals)),
                        "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0}
        out[variant] = agg
    return out


def plot(runs: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 4.2), dpi=100, layout="constrained")
    ax_acc, ax_noise, ax_dead, ax_ev = fig.subplots(1, 4)
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:gray", "tab:purple", "tab:brown", "tab:olive")
    colors = dict(zip(dict.fromkeys(r["variant"] for r in runs), palette))
    for r in runs:
        c = colors.get(r["variant"], "gray")
        label = r["variant"] if r["seed"] == min(x["seed"] for x in runs if x["variant"] == r["variant"]) else None
        steps, acc = zip(*r["eval_curve"])
        ax_acc.plot(steps, acc, color=c, alpha=0.8, marker="o", markersize=3, label=label)
        pts = [(s, v) for s, v in r["grad_noise_curve"] if v is not None and math.isfinite(v)]
        if pts:
            s, v = np.asarray(pts).T
            k = 15  # a moving average: the per-step estimate is noisy
            smooth = np.convolve(v, np.ones(k) / k, mode="valid") if len(v) >= k else v
            ax_noise.plot(s[len(s) - len(smooth):], smooth, color=c, alpha=0.8, label=label)
        ev = [(s, v) for s, v in r.get("explained_variance_curve", []) if v is not None and math.isfinite(v)]
        if ev:
            s, v = np.asarray(ev).T
            k = 10
            smooth = np.convolve(v, np.ones(k) / k, mode="valid") if len(v) >= k else v
            ax_ev.plot(s[len(s) - len(smooth):], smooth, color=c, alpha=0.8, label=label)
    for i, (variant, c) in enumerate(colors.items()):
        rs = [r for r in runs if r["variant"] == variant]
        if rs:
            ax_dead.bar(i - 0.2, np.mean([r["frac_zero_std"] for r in rs]), 0.4, color=c, label="observed" if i == 0
                        else None)
            ax_dead.bar(i + 0.2, np.mean([r["frac_zero_std_expected"] for r in rs]), 0.4, color=c, alpha=0.4,
                        label="expected from pass rate" if i == 0 else None)
    ax_dead.set_xticks(range(len(colors)), list(colors))
    ax_acc.set(title="held-out accuracy (each seed)", xlabel="step")
    ax_noise.set(title="gradient noise scale B_simple (15-step mean)", xlabel="step", ylabel="rows", yscale="log")
    ax_dead.set(title="dead-group fraction (mean over steps)")
    ax_ev.set(title="critic explained variance (10-step mean)", xlabel="step", ylim=(-0.3, 0.4))
    for ax in (ax_acc, ax_noise, ax_dead, ax_ev):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="benchmarks/results/stability")
    parser.add_argument("--variants", nargs="+", default=SECOND_EDITION, choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: the config's)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs/demo_cpu.yaml")
    parser.add_argument("--value-warmup", type=int, default=50, help="VAPO's ppo.value_warmup_steps")
    parser.add_argument("--summarise-only", action="store_true", help="summarise the runs already in --output")
    parser.add_argument("--append", action="store_true", help="keep the other runs in summary.json")
    parser.add_argument("--critic-path", default=None, help="vapo_rm's critic: a reward model's HF directory")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="more overrides for every run")
    args = parser.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarise_only:  # the committed runs' metrics summarised again (wall times as measured)
        old = json.loads((out / "summary.json").read_text())["runs"]
        runs = [summarise(r["variant"], r["seed"], read_run(out / f"{r['variant']}_s{r['seed']}"), r["wall_s"])
                for r in old]
        return finish(runs, out)
    runs = []
    if args.append and (out / "summary.json").exists():  # more variants beside an earlier invocation's
        runs = [r for r in json.loads((out / "summary.json").read_text())["runs"]
                if not (r["variant"] in args.variants and r["seed"] in args.seeds)]
    for seed in args.seeds:
        for variant in args.variants:
            r = run_one(variant, seed, out, args.steps, sys.executable, config=args.config,
                        value_warmup=args.value_warmup, critic_path=args.critic_path, extra=tuple(args.extra))
            print(f"{variant} seed {seed}: accuracy {r['eval_start']:.3f} -> {r['eval_final']:.3f}, noise scale "
                  f"{r['grad_noise_scale']:.0f}, dead groups {r['frac_zero_std']:.3f}, {r['wall_s']:.0f} s", flush=True)
            runs.append(r)
            (out / "summary.json").write_text(json.dumps({"runs": runs}, indent=1))
    return finish(runs, out)


def finish(runs: list[dict], out: Path) -> int:
    at_equal_tokens(runs)
    (out / "summary.json").write_text(json.dumps({"runs": runs, "variants": aggregate(runs)}, indent=1))
    plot(runs, out / "stability.png")
    print(json.dumps(aggregate(runs), indent=1))
    return 0


def read_run(run_dir: Path) -> list[dict]:
    with gzip.open(run_dir / "metrics.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
