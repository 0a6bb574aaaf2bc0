"""stability.md's third edition (issue 46): benchmarks/stability_v3.py's summary.json, its leak
check, the learning rates its sweeps chose, and each arm against GRPO paired by seed."""

from __future__ import annotations

from figure_blocks import RESULTS, load, minutes, table

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


BLOCKS = {}
if (RESULTS / SUMMARY).exists():  # the blocks come with the study's result file
    BLOCKS = {"stab-v3-setup": render_setup, "stab-v3-table": render_table}
