"""stability.md's third edition (issue 46): benchmarks/stability_v3.py's summary.json, its leak
check, the learning rates its sweeps chose, and each arm against GRPO paired by seed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from figure_blocks import RESULTS, load, minutes, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paired_stats import paired  # noqa: E402

SUMMARY = "stability_v3/summary.json"
NAMES = {"grpo": "GRPO", "dr_grpo": "Dr. GRPO", "rloo": "RLOO", "cispo": "CISPO", "dapo": "DAPO", "ppo": "PPO",
         "vapo": "VAPO", "grpo_random": "GRPO, random reward"}


def _ci(c: dict, signed: bool = False) -> str:
    f = "+.3f" if signed else ".3f"
    return f"{c['mean' if 'mean' in c else 'diff']:{f}} [{c['lo']:{f}}, {c['hi']:{f}}]"


def render_setup() -> str:
    """The command, the leak check and the sweeps' choices."""
    d = load(SUMMARY)
    leaks = d["leaks"]
    rows = [[edition, str(v["train"]), str(v["test"]), str(v["test_twin_in_train"]), str(v["test_question_in_train"])]
            for edition, v in (("third (`commutative_twins: false`)", leaks["v3"]), ("second", leaks["v2"]))]
    sweep = [[NAMES[arm], ", ".join(f"{lr}: {acc:.3f}" for lr, acc in got.items()), f"{d['policy_lr'][arm]:g}"]
             for arm, got in d["lr_sweep"].items()]
    critics = "; ".join(f"{NAMES[arm]} {', '.join(f'{lr}: {ev:.3f}' for lr, ev in got.items())} (chose {d['critic_lr'][arm]:g})"
                        for arm, got in d.get("critic_lr_sweep", {}).items())
    train = sum(r["wall_s"] for r in d["runs"])  # each run's own time (a resumed study reads finished ones back)
    return (f"`{d['command']}` ({d['date']}; {len(d['runs'])} runs besides the critics' warm-ups, "
            f"{minutes(train)} of runs in all); this project's 2-core CPU machine. Per-run metrics (gzipped) "
            "under `benchmarks/results/stability_v3/`.\n\n"
            + table(["held-out split", "train problems", "held-out problems", "held-out with its twin (b+a) in train",
                     "held-out question in train"], rows)
            + "\nThe critics' learning rate (explained variance over the value warm-up's last 10 steps, seed 0): "
            + f"{critics}.\n\n"
            + table(["arm", "learning rate: final held-out accuracy (mean of the sweep's seeds)", "chosen"], sweep))


def render_table() -> str:
    """Each arm's final held-out accuracy over its seeds and its paired difference from GRPO."""
    d = load(SUMMARY)
    stats, by = d["stats"], {}
    for r in d["runs"]:
        if r["lr"] == d["policy_lr"][r["variant"]]:
            by.setdefault(r["variant"], {})[r["seed"]] = r["eval_final"]
    rows = []
    for arm, c in stats["arms"].items():
        v = stats.get("vs_grpo", {}).get(arm)
        versus = "" if v is None else (f"{_ci(v, signed=True)}, p {v['p']:.3f}, Holm {v['p_holm']:.3f}: "
                                       + ("**real**" if v["real"] else "noise"))
        seeds = ", ".join(f"{by[arm][s]:.3f}" for s in sorted(by.get(arm, {})))
        rows.append([NAMES[arm], str(c["n"]), _ci(c), versus or "(the reference)", seeds])
    return (table(["arm", "seeds", "final held-out accuracy, mean [95% t interval]",
                   "minus GRPO, paired by seed [95% interval], t-test p, Holm-adjusted", "per seed (final)"], rows)
            + f"\nDAPO is scored at GRPO's sampled-token budget ({stats['token_budget']:,.0f} tokens a run: its last "
            "evaluation within it); the per-seed column shows its final accuracy. A difference is called real when "
            "its Holm-adjusted p is at most 0.05 and its interval excludes 0.\n")


def _zero(x: float) -> str:
    return f"{x:.3f}".replace("-0.000", "0.000")


def _spearman(a: dict, b: dict) -> float:
    """Spearman's rank correlation of two {seed: value} (no ties expected)."""
    seeds = sorted(set(a) & set(b))
    ra, rb = (np.argsort(np.argsort([x[s] for s in seeds])) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


def _sweep_flips(d: dict) -> tuple[list[str], list[str]]:
    """(the arms whose chosen rate seed 1 alone would not have chosen, the arms whose sweep tied
    at the top: max() took the first of --lrs)."""
    flips, ties = [], []
    for arm, got in d["lr_sweep"].items():
        seed1 = {r["lr"]: r["eval_final"] for r in d["runs"] if r["variant"] == arm and r["seed"] == 1
                 and r.get("stage") == "sweep"}
        if seed1 and max(seed1, key=seed1.get) != d["policy_lr"][arm]:
            flips.append(NAMES[arm])
        if sorted(got.values())[-2:].count(max(got.values())) == 2:
            ties.append(NAMES[arm])
    return flips, ties


def render_verdict() -> str:
    """What the study says, each statement computed from summary.json: which differences are real,
    how much the seed moves the result, DAPO at equal steps against equal tokens, the critics, and
    what decided the sweeps."""
    d = load(SUMMARY)
    stats, chosen = d["stats"], {}
    for r in d["runs"]:
        if r["lr"] == d["policy_lr"][r["variant"]]:
            chosen.setdefault(r["variant"], {})[r["seed"]] = r
    versus = stats["vs_grpo"]
    real = [NAMES[a] for a, v in versus.items() if v["real"]]
    objectives = {a: v for a, v in versus.items() if a not in ("grpo_random", "dapo")}
    real_objectives = [NAMES[a] for a, v in objectives.items() if v["real"]]
    widest = max(objectives.values(), key=lambda v: abs(v["diff"]))
    halves = sorted((v["hi"] - v["lo"]) / 2 for v in objectives.values())
    lines = [f"- Real (Holm-adjusted p at most 0.05, interval excluding 0): {', '.join(real) or 'none'}. "
             + (f"Objectives that differ from GRPO beyond noise: {', '.join(real_objectives)}. " if real_objectives else
                "No objective differs from GRPO beyond noise. ")
             + f"The largest paired difference of one (DAPO at equal tokens aside) is {widest['diff']:+.3f}; the paired "
             f"intervals' half-widths run from {halves[0]:.3f} to {halves[-1]:.3f}: with {versus['ppo']['n']} seeds a "
             f"difference smaller than about {halves[0]:.3f} could not be seen at all."]
    grpo = {s: r["eval_final"] for s, r in chosen["grpo"].items()}
    warm = {s: r["eval_start"] for s, r in chosen["grpo"].items()}
    weak = min(warm, key=warm.get)
    arms_weak = [r[weak]["eval_final"] for a, r in chosen.items() if a != "grpo_random" and weak in r]
    control_weak = chosen["grpo_random"][weak]["eval_final"] if weak in chosen.get("grpo_random", {}) else None
    lines.append(f"- The seed moves the result more than any objective: GRPO's final accuracy runs from "
                 f"{min(grpo.values()):.3f} to {max(grpo.values()):.3f} over its seeds, following each seed's warm start "
                 f"({', '.join(f'{warm[s]:.3f}' for s in sorted(warm))}; rank correlation {_spearman(warm, grpo):.2f}). From seed {weak}'s ({warm[weak]:.3f}) no "
                 f"arm got far: {min(arms_weak):.3f} to {max(arms_weak):.3f} at the end"
                 + (f", against {control_weak:.3f} for the random-reward control of that seed" if control_weak is not None else "")
                 + f", although {1 - chosen['grpo'][weak]['frac_zero_std']:.2f} of GRPO's groups there had rewards that "
                 "differed.")
    if "dapo" in chosen:
        dapo_end = paired({s: r["eval_final"] for s, r in chosen["dapo"].items()}, grpo)
        wins = sum(chosen["dapo"][s]["eval_final"] > grpo[s] for s in grpo)
        tokens = float(np.mean([r["sampled_tokens"] for r in chosen["dapo"].values()]))
        v = versus["dapo"]
        lines.append(f"- DAPO after the same steps is above GRPO on {wins} of {len(grpo)} seeds ({dapo_end['diff']:+.3f}, "
                     f"unadjusted p {dapo_end['p']:.3f}, outside the family above) having sampled "
                     f"{tokens / stats['token_budget']:.1f}x GRPO's tokens; at GRPO's token budget it is "
                     f"{v['diff']:+.3f} (Holm {v['p_holm']:.3f}: " + ("real" if v["real"] else "not beyond noise")
                     + "): what it gains, it gains with samples.")
    ev = {a: float(np.mean([r["explained_variance_late"] for r in chosen[a].values()])) for a in ("ppo", "vapo") if a in chosen}
    sweep = [x for got in d.get("critic_lr_sweep", {}).values() for x in got.values()]
    critics_real = [NAMES[a] for a in ev if versus[a]["real"]]
    lines.append(f"- The critics' explained variance at the end of the warm-ups was {_zero(min(sweep))} to "
                 f"{_zero(max(sweep))} at the three rates (so the rate chosen was chosen among values near 0), and "
                 + ", ".join(f"{NAMES[a]} {_zero(v)}" for a, v in ev.items())
                 + " over the last steps of the compared runs. "
                 + (f"{', '.join(critics_real)} differed from GRPO beyond noise." if critics_real else
                    "Neither critic-based arm differs from GRPO beyond noise."))
    flips, ties = _sweep_flips(d)
    if flips or ties:
        lines.append(f"- The sweeps averaged seeds 0 and 1; seed 1 alone would have chosen another rate for "
                     f"{', '.join(flips) or 'no arm'}" + (f", and {', '.join(ties)}'s top two rates tied (the first "
                                                          "listed was taken)" if ties else "") + ".")
    return "\n".join(lines) + "\n"


BLOCKS = {}
if (RESULTS / SUMMARY).exists():  # the blocks come with the study's result file
    BLOCKS = {"stab-v3-setup": render_setup, "stab-v3-table": render_table, "stab-v3-verdict": render_verdict}
