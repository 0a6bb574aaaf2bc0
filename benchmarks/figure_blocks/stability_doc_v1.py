"""stability.md's first edition (results/stability/): its Reproduce line, sampled tokens, table and what it
shows. Helpers: stability_doc.py."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from figure_blocks import table
from figure_blocks.rl import _f, _rows
from figure_blocks.stability_doc import (ALGOS, SHORT, V1, _and, _lab, _se, _seeds, _stat, _wall_minutes, _word,
                                         _wrap)

# -- the first edition -------------------------------------------------------------------------------------------

def render_v1_reproduce() -> str:
    """stability.md "First edition": the Reproduce line's time, from the wall times of results/stability/summary.json."""
    runs, total = _wall_minutes(V1)
    return f"**Reproduce** (2 CPU cores, about {5 * round(total / 5)} minutes for {runs} runs):\n"


def render_v1_tokens() -> str:
    """stability.md "First edition": the sampled tokens per run, from results/stability/summary.json."""
    _, runs = _lab(V1)
    real = [r["sampled_tokens"] / 1e3 for (n, _), r in runs.items() if n in ALGOS]
    control = [r["sampled_tokens"] / 1e3 for (n, _), r in runs.items() if n == "grpo_random"]
    return ("Every run sampled the same prompts per step, group size and token cap for the same number of steps:\n"
            f"{statistics.mean(real):.0f}k sampled tokens per run ({min(real):.1f}k to {max(real):.1f}k; the random "
            f"control {min(control):.0f}k to {max(control):.0f}k).\n")


def render_v1_table() -> str:
    """stability.md "What was measured" (first edition): the table, from results/stability/summary.json."""
    v, runs = _lab(V1)
    best = max(v[n]["eval_final"]["mean"] for n in ALGOS)
    rows = []
    for n in (*ALGOS, "grpo_random"):
        s = v[n]
        start = statistics.mean(runs[n, k]["eval_start"] for k in s["seeds"])
        acc = _stat(s["eval_final"], bold=s["eval_final"]["mean"] == best or n == "grpo_random")
        rows.append([SHORT[n], f"{start:.3f} -> {acc}", f"{s['pass_final']['mean']:.3f}",
                     " / ".join(f"{runs[n, k]['eval_final']:.3f}" for k in s["seeds"]),
                     _stat(s["grad_noise_scale"], ".0f"),
                     f"{s['frac_zero_std']['mean']:.3f} / {s['frac_zero_std_expected']['mean']:.3f}",
                     _stat(s["explained_variance_late"]), _stat(s["wall_s"], ".0f").replace(" [", " s [")])
    return table(["variant", "accuracy, step 0 -> 300", "pass@4 at 300", "seed 0 / 1 / 2", "grad noise scale (rows, mean)",
                  "dead groups observed / expected", "PPO explained variance (2nd half)", "wall time per run"], rows)


_V1_SHOWS = """\
- **The seed matters more than the algorithm.** The warm start left seed {weak} at {weak_acc:.3f} held-out accuracy
  ({strong} at {strong_acc}); every algorithm then ends near {weak_end} on it and near {strong_lo:.2f}
  to {strong_hi:.2f} on the others. The spread across seeds ({by_seed:.1f}) is {times} times the spread across algorithms.
- **Within a seed, GRPO finished first on {first}**, by {leads} over the next
  best; Dr. GRPO, RLOO and PPO are within {within:.2f} of each other in every seed. With {samples} held-out
  samples per evaluation the standard error of one accuracy is about {se:.2f}, so the ranking among the
  three is not resolved; GRPO's lead is small but repeated in all three seeds.
- **PPO's critic explains nothing here.** The value head learns the mean return (`value/mean` tracks
  the reward) but its explained variance stays at {ev}: a linear read-out of this tiny policy's
  last hidden state cannot tell a correct 4-token answer from a wrong one before the reward. PPO
  then behaves like REINFORCE with a learned mean baseline and GAE's token credit, and lands with
  the other baselines, not above them. On this task the "return to critic-based PPO" buys nothing;
  a larger critic (a separate model) is the fair next test and is not built yet.
- **Gradient noise scale is close to the batch.** B_simple is {noise} rows for a batch of 256 rows
  with every algorithm: the per-step gradient is mostly noise, so larger batches (or more prompts
  per step) should still pay on this task. Dividing by the group std (GRPO) against not dividing
  (Dr. GRPO, RLOO) did not change it measurably ({noise_grpo:.0f} against {noise_dr:.0f} and {noise_rloo:.0f}); the claim that
  uniform-ish groups blow up gradient variance under std scaling does not show at this scale.
- **Dead groups are above what the pass rate predicts, equally for every algorithm**: {dead:.0%} observed
  against {expected} expected if every prompt had the batch's pass rate. The excess is the spread of
  difficulty (some sums are always right, some never), which dynamic sampling or a curriculum
  addresses; it is a property of the task and the policy, not of the advantage estimator. On seed {weak}
  (weak start) {dead_weak} of groups were dead, almost all of them all-wrong.
- **The random-reward control destroys the policy**: held-out accuracy falls from {r_start:.2f} to {r_end:.2f} on
  average ({r_seeds}), the dead-group fraction rises to {r_dead:.2f}, and
  the true reward falls with it. So the gains above come from the reward, not from the update's
  mechanics (clipping, KL, sampling at temperature 1). This tiny model has no pretrained prior for
  spurious rewards to amplify, unlike the Qwen-Math results that motivate the control.
  `grpo-jax report` flags these runs for {report_control} ([screenshot](results/stability/report_grpo_random_s0.png)).
  Of the {n_real} real runs it flags {report_real}.
- **Cost is the same.** Wall times per run ({wall_lo:.0f} to {wall_hi:.0f} s, warm start and {n_evals} evaluations included) vary
  with what else ran on the shared 2-core machine, not with the algorithm: PPO's values come out of
  the same forward pass as the log-probs, and its total update time (`perf/train_s` summed: {ppo_lo:.0f} to
  {ppo_hi:.0f} s) was {within_range} the others' range ({rest_lo:.0f} to {rest_hi:.0f} s).
"""


def _v1_seed_facts(v: dict, runs: dict) -> dict:
    """Bullets 1 and 2: the seed against the algorithm, GRPO's lead within a seed."""
    seeds = v["grpo"]["seeds"]
    f = {k: r["eval_final"] for k, r in runs.items()}
    start = {n: runs["grpo", n]["eval_start"] for n in seeds}
    weak = min(seeds, key=start.get)
    strong = [n for n in seeds if n != weak]
    spread = lambda xs: max(xs) - min(xs)  # noqa: E731
    by_seed = statistics.mean(spread([f[a, n] for n in seeds]) for a in ALGOS)  # as figure_blocks/rl.py's
    by_algo = statistics.mean(spread([f[a, n] for a in ALGOS]) for n in seeds)
    leads = [f["grpo", n] - max(f[a, n] for a in ALGOS if a != "grpo") for n in seeds]
    first = [n for n, g in zip(seeds, leads) if g > 0]
    weak_end, strong_end = [f[a, weak] for a in ALGOS], [f[a, n] for a in ALGOS for n in strong]
    return dict(weak=weak, weak_acc=start[weak], strong=_seeds(strong, 0), strong_acc=_and(f"{start[n]:.2f}" for n in strong),
                weak_end=f"{min(weak_end):.2f} to {max(weak_end):.2f}", strong_lo=min(strong_end), strong_hi=max(strong_end),
                by_seed=by_seed, times=_word(round(by_seed / by_algo)),
                first=f"all {_word(len(seeds))}" if len(first) == len(seeds) else _seeds(first, 0),
                leads=_and(f"{g:+.3f}" for g in leads),
                within=math.ceil(100 * max(spread([f[a, n] for a in ALGOS[1:]]) for n in seeds)) / 100,
                **dict(zip(("samples", "se"), _se(V1, "grpo_s0"))))


_FLAGS = {"kl_drift": "KL drift", "heldout_regression": "held-out regression", "entropy_falling": "falling entropy",
          "dead_groups": "dead groups above the pass-rate prediction (the weak warm start)",
          "dead_groups_share": "many dead groups", "heldout_below_best": "held-out accuracy below its best"}


def _v1_report(rows: dict, seeds: list[int], samples: int) -> dict:
    """What `grpo-jax report` (grpo_jax.observe.health_checks.diagnose) flags in the first edition's runs."""
    from grpo_jax.observe.flags import FAILURE
    from grpo_jax.observe.health_checks import diagnose
    from grpo_jax.observe.heldout_checks import HELDOUT_REGRESSION

    flags = {k: diagnose(r, eval_samples=samples) for k, r in rows.items()}
    failures = {k: [f.key for f in fs if f.level == FAILURE] for k, fs in flags.items()}
    control = []
    keys = {f for n, k in failures if n == "grpo_random" for f in failures[n, k]}
    for key in sorted(keys, key=lambda f: list(_FLAGS).index(f) if f in _FLAGS else len(_FLAGS)):
        on = [k for k in seeds if key in failures["grpo_random", k]]
        off = [k for k in seeds if k not in on]
        which = f"all {_word(len(seeds))}" if not off else _seeds(on, 0)
        if key == "heldout_regression" and off:
            which += f"; {_seeds(off, 0)} started too low to fall {HELDOUT_REGRESSION:g}"
        control.append(f"{_FLAGS.get(key, key)} ({which})")
    real = [k for k in rows if k[0] != "grpo_random"]
    flagged = [k for k in real if failures[k]]
    notices = {_FLAGS.get(f.key, f.key): None for k in real if k not in flagged for f in flags[k]}
    noticed = sum(1 for k in real if k not in flagged and flags[k])
    what = _and(dict.fromkeys(_FLAGS.get(f, f) for k in flagged for f in failures[k]))
    return dict(report_control=_and(control), n_real=_word(len(real)), report_real=(
        f"{_word(len(flagged))}, {_and(SHORT[n] for n, _ in flagged)} on {_seeds(sorted({k for _, k in flagged}), 0)}, "
        f"for {what}; the other {_word(len(real) - len(flagged))} raise no failure ({_word(noticed)} of them a notice: "
        f"{' or '.join(notices)})"))


def render_v1_shows() -> str:
    """stability.md "What it shows" (first edition): the bullets, from results/stability/summary.json and the runs'
    metrics.jsonl.gz (`perf/train_s`, and what `grpo-jax report`'s checks flag in them)."""
    v, runs = _lab(V1)
    rows = {k: _rows(f"{V1}/{k[0]}_s{k[1]}/metrics.jsonl.gz") for k in runs}
    train = {k: sum(r.get("perf/train_s", 0) for r in rs if "reward/mean" in r) for k, rs in rows.items()}
    ppo, rest = [t for k, t in train.items() if k[0] == "ppo"], [t for k, t in train.items() if k[0] != "ppo"]
    real, ctl = [r for (n, _), r in runs.items() if n in ALGOS], [runs["grpo_random", k] for k in v["grpo"]["seeds"]]
    weak = _v1_seed_facts(v, runs)["weak"]
    noise = [round(r["grad_noise_scale"], -1) for r in real]
    expected = [100 * v[a]["frac_zero_std_expected"]["mean"] for a in ALGOS]
    dead_weak = [100 * runs[a, weak]["frac_zero_std"] for a in ALGOS]
    return _wrap(_V1_SHOWS.format(
        **_v1_seed_facts(v, runs), ev=_f(v["ppo"]["explained_variance_late"]["mean"], ".3f"),
        noise=f"{min(noise):.0f} to {max(noise):.0f}", noise_grpo=v["grpo"]["grad_noise_scale"]["mean"],
        noise_dr=v["dr_grpo"]["grad_noise_scale"]["mean"], noise_rloo=v["rloo"]["grad_noise_scale"]["mean"],
        dead=statistics.mean(v[a]["frac_zero_std"]["mean"] for a in ALGOS),
        expected=f"{min(expected):.0f} to {max(expected):.0f}%", dead_weak=f"{min(dead_weak):.0f} to {max(dead_weak):.0f}%",
        r_start=statistics.mean(r["eval_start"] for r in ctl), r_end=v["grpo_random"]["eval_final"]["mean"],
        r_seeds=", ".join(f"{r['eval_start']:.2f} -> {r['eval_final']:.2f}" for r in ctl),
        r_dead=v["grpo_random"]["frac_zero_std"]["mean"],
        **_v1_report(rows, v["grpo"]["seeds"], _se(V1, "grpo_s0")[0]),
        wall_lo=min(r["wall_s"] for r in runs.values()), wall_hi=max(r["wall_s"] for r in runs.values()),
        n_evals=len(real[0]["eval_curve"]), ppo_lo=min(ppo), ppo_hi=max(ppo),
        within_range="within" if min(rest) <= min(ppo) and max(ppo) <= max(rest) else "outside",
        rest_lo=min(rest), rest_hi=max(rest)))


BLOCKS: dict[str, Callable[[], str]] = {
    "stab-v1-reproduce": render_v1_reproduce,
    "stab-v1-tokens": render_v1_tokens,
    "stab-v1-table": render_v1_table,
    "stab-v1-shows": render_v1_shows,
}
