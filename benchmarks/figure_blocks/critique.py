"""RESULTS.md "The critique of GRPO, measured (issue 46)": the hacking, over-optimisation and
retention experiments of benchmarks/critique.py, from their summary.json files under
results/critique/ (each run's metrics beside them)."""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from figure_blocks import RESULTS, load, minutes, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paired_stats import mean_ci, paired  # noqa: E402


def _ci(values, fmt=".3f") -> str:
    """The mean with its 95% t interval from 3 values on; with 2, the mean and both values."""
    c = mean_ci(values)
    if c["n"] < 3:
        return f"{c['mean']:{fmt}}" + (f" ({', '.join(f'{v:{fmt}}' for v in values)})" if c["n"] == 2 else "")
    return f"{c['mean']:{fmt}} [{c['lo']:{fmt}}, {c['hi']:{fmt}}]"


def _groups(runs: list[dict], key: str) -> dict:
    out = {}
    for r in runs:
        if key in r:
            out.setdefault(r[key], []).append(r)
    return out


def _flags(rs: list[dict]) -> str:
    counts = Counter(f for r in rs for f in r["flags"])
    return ", ".join(f"`{k}` {n}/{len(rs)}" for k, n in sorted(counts.items())) or "none"


def _header(d: dict) -> str:
    runs, last = [], None
    for p in d.get("parts") or [d]:  # a part that resumed the same command: its commit and time beside
        when = f"{p['date']}, commit {p['commit']}, {minutes(p['wall_s'])}"
        runs += [runs.pop()[:-1] + f"; resumed: {when})"] if p["command"] == last else [f"`{p['command']}` ({when})"]
        last = p["command"]
    return f"{' then '.join(runs)}; {d['machine']}. Per-run metrics beside the summary in `benchmarks/results/critique/`.\n\n"


def render_hacking() -> str:
    d = load("critique/hacking/summary.json")
    arms = _groups(d["runs"], "arm")
    strict_end = {r["seed"]: r["evals"][-1]["eval/verifier_accuracy"] for r in arms["strict"]}
    rows = []
    for arm, rs in arms.items():
        first, last = [r["evals"][0] for r in rs], [r["evals"][-1] for r in rs]
        gap = lambda es: _ci([e["eval/accuracy"] - e["eval/verifier_accuracy"] for e in es])  # noqa: E731
        cost = "" if arm == "strict" else _paired({r["seed"]: r["evals"][-1]["eval/verifier_accuracy"] for r in rs},
                                                  strict_end)
        rows.append([f"`{arm}`", str(len(rs)), _ci([e["eval/accuracy"] for e in first]) + " -> "
                     + _ci([e["eval/accuracy"] for e in last]), _ci([e["eval/verifier_accuracy"] for e in last]),
                     gap(first), gap(last), cost, _flags(rs)])
    steps = d["runs"][0]["evals"][-1]["step"]
    per_seed = "; ".join(f"`{arm}` " + ", ".join(f"{r['evals'][-1]['eval/verifier_accuracy']:.3f}" for r in rs)
                         for arm, rs in arms.items())
    return (_header(d) + table(["trained on", "seeds", f"its own judge, step 0 -> {steps}", f"strict verifier, step {steps}",
                                "gap (own - strict), step 0", f"gap, step {steps}", "strict accuracy vs the strict-trained arm",
                                "report flags (runs)"], rows)
            + f"\nMeans over seeds with 95% t intervals (128 held-out prompts x 4 samples per evaluation); the strict "
            f"accuracy against the arm trained on the strict verifier is paired by seed (the same warm start): mean "
            f"difference [95% t interval], paired t-test p. Per seed, the strict verifier's accuracy at step {steps}: "
            f"{per_seed}.\n")


def _paired(a: dict, b: dict) -> str:
    r = paired(a, b)
    return f"{r['diff']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}], p {r['p']:.2f}"


def render_overopt() -> str:
    d = load("critique/overopt/summary.json")
    rows = []
    for beta, rs in sorted(_groups(d["runs"], "beta").items()):
        gold = [[e["eval/verifier_accuracy"] for e in r["evals"]] for r in rs]
        peak = [int(np.argmax(g)) for g in gold]
        kl_peak = [r["evals"][i]["kl_window"] for r, i in zip(rs, peak)]
        rows.append([f"{beta:g}", str(len(rs)), _ci([g[0] for g in gold]), _ci([max(g) for g in gold]),
                     _ci([r["evals"][i]["step"] for r, i in zip(rs, peak)], ".0f"), _ci(kl_peak, ".3f"),
                     _ci([g[-1] for g in gold]), _ci([r["evals"][-1]["kl_window"] for r in rs], ".3f"),
                     _ci([r["evals"][0]["eval/reward_mean"] for r in rs], ".2f") + " -> "
                     + _ci([r["evals"][-1]["eval/reward_mean"] for r in rs], ".2f"), _flags(rs)])
    rm = (RESULTS / "critique/overopt/rm_wall_s.txt")
    rm_s = f" (the proxy's training: {minutes(float(rm.read_text()))})" if rm.exists() else ""
    return (_header(d) + table(["grpo.beta", "seeds", "gold at step 0", "gold at its peak", "peak step",
                                "kl/k3 at the peak", "gold at the end", "kl/k3 at the end",
                                "proxy (held-out RM score)", "report flags (runs)"], rows)
            + f"\nGold: the strict verifier's held-out accuracy; proxy: the reward model's held-out mean score{rm_s}; "
            "kl/k3: the mean of the updates' k3 estimates of KL(pi || pi_0) since the evaluation before (nats per "
            "token). Means over seeds with 95% t intervals. The curve (gold and proxy against that KL): "
            "`benchmarks/results/critique/overopt/overopt.png`.\n" + _beta_pairs(d["runs"]))


def _beta_pairs(runs: list[dict]) -> str:
    """Gold at the end, each KL coefficient against the smallest, paired by seed."""
    by = {beta: {r["seed"]: r["evals"][-1]["eval/verifier_accuracy"] for r in rs}
          for beta, rs in sorted(_groups(runs, "beta").items())}
    low = min(by)
    parts = [f"grpo.beta {beta:g}: {_paired(by[beta], by[low])}" for beta in by if beta != low]
    return (f"Gold at the end against grpo.beta {low:g}, paired by seed (mean difference [95% t interval], "
            f"paired t-test p): " + "; ".join(parts) + ".\n")


def render_retention(path: str) -> str:
    d = load(f"{path}/summary.json")
    rows = []
    for beta, rs in sorted(_groups(d["runs"], "beta").items()):
        first, last = [r["evals"][0] for r in rs], [r["evals"][-1] for r in rs]
        rows.append([f"{beta:g}", str(len(rs)), f"{last[0]['step']}", _ci([e["retention/kl"] for e in last], ".4f"),
                     _ci([e["retention/general_nll"] for e in first]) + " -> " + _ci([e["retention/general_nll"] for e in last]),
                     _ci([e["eval/accuracy"] for e in first]) + " -> " + _ci([e["eval/accuracy"] for e in last]),
                     _flags(rs)])
    # each evaluation's retention/kl (the mean over seeds), to see its trend
    trend = {f"{b:g}": ", ".join(f"{np.mean([r['evals'][i]['retention/kl'] for r in rs]):.4f}"
                                 for i in range(min(len(r["evals"]) for r in rs)))
             for b, rs in sorted(_groups(d["runs"], "beta").items())}
    steps = ", ".join(str(e["step"]) for e in d["runs"][0]["evals"])
    return (_header(d) + table(["grpo.beta", "seeds", "steps", "retention/kl at the end", "retention/general_nll",
                                "held-out accuracy", "report flags (runs)"], rows)
            + f"\nretention/kl at the evaluations of steps {steps}: "
            + "; ".join(f"grpo.beta {b}: {t}" for b, t in trend.items()) + ".\n")


def render_credit_critics(path: str = "critique/credit_critics") -> str:
    """One stage-1 sweep of `critique.py credit` (value warm-ups alone): each critic's explained
    variance by learning rate (a critic model's trunk rate where it had its own)."""
    d = load(f"{path}/summary.json")
    rows = []
    for r in d["runs"]:
        if r.get("stage") != "critic_lr":
            continue
        ev = r["ev_curve"]
        plateau = r["ev_plateau_step"]
        flat = "none: it never rose above 0.05" if max(ev) < 0.05 else None
        rate = f"{r['critic_lr']:g}" + (f" (trunk {r['trunk_lr']:g})" if r.get("trunk_lr") else "")
        rows.append([f"`{r['kind']}`", rate, f"{ev[len(ev) // 2 - 1]:.3f}", f"{r['ev_end']:.3f}",
                     f"{max(ev):.3f}", flat or ("not within the warm-up" if plateau is None else f"step {plateau}")])
    chosen = {}  # each kind's best rate (what `critic_warmups` picks), over all the parts of an --append
    for r in sorted((r for r in d["runs"] if r.get("stage") == "critic_lr"), key=lambda r: r["ev_end"]):
        chosen[r["kind"]] = r["critic_lr"]
    steps = len(next(r for r in d["runs"] if r.get("stage") == "critic_lr" and r.get("ev_curve"))["ev_curve"])
    picked = ", ".join(f"{'value head' if k == 'head' else 'critic model'} {v:g}" for k, v in sorted(chosen.items()))
    return (_header(d) + table(["critic", "critic learning rate", f"explained variance at step {steps // 2}",
                                f"over the last 10 of {steps} steps", "its highest", "plateau"], rows)
            + (f"\n{d['note'][0].upper() + d['note'][1:]}.\n" if d.get("note") else "")
            + f"\nChosen (the highest explained variance at the end): {picked}. A plateau: the first 10-step "
            f"window whose mean moved less than 0.02 from the window before. The curves: `benchmarks/results/{path}/credit.png`.\n")


ORACLES = (("credit_oracle", "the last total (the config's reward)"),
           ("credit_oracle_derivation", "every total (`derivation_exact`)"),
           ("credit_oracle_derivation_sft1500", "every total, a 1500-step warm start"),
           ("credit_oracle_shared", "every total, the comparison's shared warm start (800 steps)"))


def render_credit_oracle() -> str:
    """benchmarks/credit_oracle.py's runs side by side: how much of the return each value explains."""
    runs = [(load(f"critique/{name}/summary.json"), what) for name, what in ORACLES
            if (RESULTS / "critique" / name / "summary.json").exists()]
    names = {"oracle_prefix": "a table by (position, prefix still gold)",
             "oracle_last": "a table by (position, prefix still gold, last finished total right)",
             "position": "a table by position alone (the mean per position)",
             "group_mean": "the mean reward of the row's 7 group-mates (RLOO's baseline; GRPO's counts the row too)"}
    rows = [[names[k], *(f"{d['explained_variance'][k]:.3f}" for d, _ in runs)] for k in names]
    rows += [["accuracy of the rollouts (rows)", *(f"{d['accuracy']:.3f} ({d['rows']})" for d, _ in runs)],
             ["rows that leave the gold derivation; median character of the first slip",
              *(f"{d['first_slip_position']['rows_with_slip']}; {d['first_slip_position']['median']:.0f}" for d, _ in runs)]]
    commands = "; ".join(f"`{d['command']}` ({d['date']}, {minutes(d['wall_s'])})" for d, _ in runs)
    return (f"{commands}; this project's 2-core CPU machine. Each run's rows beside its summary.\n\n"
            + table(["value of each completion token's state: explained variance, reward on", *(w for _, w in runs)], rows)
            + "\nTables fitted on half the prompts and scored on the other half (cross-fitted both ways).\n")


def render_credit_verifier() -> str:
    """benchmarks/credit_verifier.py: the chain reward model's held-out pair accuracy, then the
    warm-up of the critic started from it."""
    d = load("critique/credit_verifier/summary.json")
    acc = d["rm_pair_accuracy"]
    return (f"`{d['command']}` ({d['date']}, {minutes(d['wall_s'])}, of which the reward model {minutes(d['rm_wall_s'])}); "
            f"this project's 2-core CPU machine. The reward model's held-out pair accuracy (gold prefix against a slipped "
            f"one): {acc[0][1]:.3f} at step {acc[0][0]}, {acc[-1][1]:.3f} at step {acc[-1][0]}. Its critic's warm-up:\n\n"
            + render_credit_critics("critique/credit_verifier/critic").split("\n\n", 1)[1])


def render_credit_rm_probe() -> str:
    """benchmarks/credit_oracle.py --rm: the frozen chain reward model's score as a value."""
    d = load("critique/credit_rm_probe/summary.json")
    ev, first = d["explained_variance"], d["rm_gold_first"]
    return (f"`{d['command']}` ({d['date']}, {minutes(d['wall_s'])}; the reward model is credit_verifier.py's, not "
            f"committed: its run makes it). On the same {d['rows']} rows: the score as a value (a least-squares line per "
            f"position, cross-fitted) explains {ev['rm_linear']:.3f} of the return's variance, the oracle's table "
            f"{ev['oracle_prefix']:.3f}. The score puts a still-gold state above a slipped one at the same position in "
            f"{first['same_prompt']:.3f} of the pairs from the same prompt and {first['any_prompt']:.3f} of the pairs "
            "from any prompt.\n")


def render_credit_fit() -> str:
    """benchmarks/credit_fit.py: the critics' networks fitted at rest to the shared warm start's
    rows, scored on the held-out prompts, beside the oracle's table on the same rows."""
    d = load("critique/credit_fit/summary.json")
    oracle = load("critique/credit_oracle_shared/summary.json")["explained_variance"]["oracle_prefix"]
    ls, every = d["head_least_squares"], d["fits"][0]["curve"][1]["step"]
    rows = [[f"value head, least squares on the frozen policy's states (ridge {ls['ridge']:g})", "-",
             f"{ls['fitted']:.3f}", f"{ls['held_out']:.3f}", "-"]]
    names = {"head": "value head on the frozen policy (Adam)", "model": "critic model: the policy's weights and a head, all trained"}
    for f in d["fits"]:
        best = next(c for c in f["curve"] if c["step"] == f["best_step"])
        rows.append([names[f["kind"]], f"{f['lr']:g}", f"{f['curve'][-1]['fitted']:.3f}", f"{f['held_out_end']:.3f}",
                     f"{best['held_out']:.3f} at step {best['step']} (fitted {best['fitted']:.3f})"])
    return (f"`{d['command']}` ({d['date']}, {minutes(d['wall_s'])}); this project's 2-core CPU machine. {d['rows']['fitted']} "
            f"rows fitted ({d['steps']} steps of {d['batch_size']}), {d['rows']['held_out']} held out (other prompts); "
            f"{d['tokens']} tokens in all. On the same rows the oracle's table explains {oracle:.3f} (cross-fitted).\n\n"
            + table(["critic", "rate", f"explained variance, fitted rows (step {d['steps']})",
                     f"held-out rows (step {d['steps']})", f"best held-out (scored every {every} steps)"], rows))


CREDIT_ARMS = {"grpo": "GRPO", "dr_grpo": "Dr. GRPO", "ppo": "PPO (value head)", "vapo": "VAPO (critic model)",
               "vapo-no_positive_lm": "VAPO without its positive-example LM loss",
               "vapo-no_length_adaptive": "VAPO without length-adaptive GAE",
               "vapo-no_decoupled_gae": "VAPO without decoupled GAE (the critic's lambda 0.95)",
               "vapo-no_warmup": "VAPO without the value warm-up", "vapo-head_critic": "VAPO with a value head"}


def _versus(rs: list[dict], ref: dict) -> str:
    mine = {r["seed"]: r["evals"][-1]["eval/accuracy"] for r in rs}
    if len(set(mine) & set(ref)) < 2:
        return "(fewer than 2 seeds in common)"
    t = paired(mine, ref)
    # (the sign-flip test's too: with 3 seeds no p below 0.25, and a t-test of equal differences says 0)
    return f"{t['diff']:+.3f} [{t['lo']:+.3f}, {t['hi']:+.3f}], p {t['p']:.3f}, sign-flip p {t['p_sign_flip']:.3f} ({t['n']} seeds)"


def render_credit_compare(path: str = "critique/credit_compare") -> str:
    """Stages 2-4 of `critique.py credit`: each arm's policy learning-rate sweep (seed 0), the arms
    at their chosen rates over seeds (against GRPO, paired by seed), VAPO's parts taken out one at a
    time (against VAPO); each critic's explained variance over its run's last 10 steps."""
    d = load(f"{path}/summary.json")
    runs = d["runs"]
    sweep = _groups([r for r in runs if r.get("stage") == "policy_lr"], "arm")
    rows = [[CREDIT_ARMS[a], ", ".join(f"{r['lr']:g}: {r['evals'][-1]['eval/accuracy']:.3f}" for r in rs)]
            for a, rs in sweep.items()]
    out = _header(d)
    shared = _shared_warm_start(d, path)
    if shared:
        out += shared
    if any(r.get("stage") == "critic_lr" for r in runs):  # stage 1: the critics' warm-ups
        out += "Stage 1, the critics' warm-ups:\n\n" + render_credit_critics(path).split("\n\n", 1)[1] + "\n"
    if rows:
        out += table(["arm", "policy learning rate: final held-out accuracy (seed 0)"], rows)
    final = lambda rs: [r["evals"][-1]["eval/accuracy"] for r in rs]  # noqa: E731
    ev = lambda rs: _ci([float(np.nanmean([np.nan if v is None else v for v in r["ev_curve"][-10:]]))  # noqa: E731
                         for r in rs]) if rs[0].get("ev_curve") else "-"  # a diverged critic's NaN is null in JSON
    rows = []
    groups = {**_groups([r for r in runs if r.get("stage") == "compare"], "arm"),
              **_groups([r for r in runs if r.get("stage") == "ablate"], "arm")}
    refs = {a: {r["seed"]: r["evals"][-1]["eval/accuracy"] for r in groups.get(a, [])} for a in ("grpo", "vapo")}
    for arm, rs in groups.items():
        against = "grpo" if "-" not in arm else "vapo"
        rows.append([CREDIT_ARMS[arm], f"{rs[0]['lr']:g}", str(len(rs)), _ci(final(rs)),
                     "(the reference)" if arm == against else _versus(rs, refs[against]), ev(rs)])
    if rows:
        out += "\n" + table(["arm", "learning rate", "seeds", "final held-out accuracy, mean [95% t interval]",
                              "minus GRPO (an ablation: minus VAPO), paired by seed [95% interval], t-test p, sign-flip p",
                              "critic explained variance, last 10 steps"], rows)
        out += ("\nEvery arm makes the same number of policy updates (a critic's warm-up steps come on top), so a "
                + ("seed pairs the RL's sampling (every run starts from the one warm start)" if shared else
                   "seed pairs the warm start") + "; the prompts after a warm-up are not the same ones. Seed 0 of "
                "each arm is its sweep's run at the chosen rate.\n")
    if d.get("finished") is False:
        out = out.rstrip("\n") + "\n"
        out += (f"\nPart way: {len({r['run'] for r in runs if r.get('stage') not in (None, 'critic_lr')})} runs of stages 2-4 "
                "finished; the same command goes on from there (finished runs are read back).\n")
    return out


def _shared_warm_start(d: dict, path: str) -> str:
    """`critique.py credit --warm-start`'s one warm start (its run beside the others, named by the
    command's --warm-start and --warm-start-seed): what it was. "" for a command without it."""
    words = d["command"].split()
    if "--warm-start" not in words:
        return ""
    steps = words[words.index("--warm-start") + 1]
    seed = words[words.index("--warm-start-seed") + 1] if "--warm-start-seed" in words else "0"
    run = RESULTS / path / f"warm_start_sft{steps}_s{seed}"
    first = next(r for r in map(json.loads, gzip.open(run / "metrics.jsonl.gz", "rt")) if "eval/accuracy" in r)
    return (f"Every run starts from one warm start ({steps} SFT steps at seed {seed}, made once by the command, "
            f"its run `{run.name}` with its weights in `base/`): held-out accuracy {first['eval/accuracy']:.3f}, "
            f"pass@{first['eval/k']:g} {first['eval/pass@k']:.3f} at step 0 on the run's reward.\n\n")


def render_credit_warmstarts() -> str:
    """benchmarks/credit_warmstarts.py: the chain's warm start by SFT steps and seed."""
    d = load("critique/credit_warmstarts/summary.json")
    seeds = sorted({r["seed"] for r in d["runs"]})
    by = {(r["sft_steps"], r["seed"]): r["warm_start_accuracy"] for r in d["runs"]}
    rows = [[str(steps), *(f"{by[(steps, s)]:.3f}" if (steps, s) in by else "-" for s in seeds)]
            for steps in sorted({r["sft_steps"] for r in d["runs"]})]
    runs_time = minutes(sum(r["wall_s"] for r in d["runs"]))  # a resumed command read finished runs back
    return (f"`{d['command']}` ({d['date']}, commit {d['commit']}, {runs_time} of runs); {d['machine']}.\n\n"
            + table(["sft.steps", *(f"seed {s}: held-out accuracy at step 0" for s in seeds)], rows)
            + ("\nPart way: the runs marked - had not run; the same command goes on.\n" if d.get("finished") is False else ""))


COSTS = (("1. over-optimisation (3 KL coefficients x 3 seeds)", "critique/overopt", True),
         ("2. retention, the demo", "critique/retention_demo", True),
         ("2. retention, SmolLM2-135M, 30 steps", "critique/retention_smollm2", False),
         ("2. retention, SmolLM2-135M, 80 steps", "critique/retention_smollm2_80", True),
         ("3. hacking a weak verifier (2 weak, 1 strict x 6 seeds)", "critique/hacking", True),
         ("4. credit: the comparison from one warm start (sweeps, 3 seeds, ablations)", "critique/credit_shared", True),
         ("4. credit: the oracle's tables at that warm start", "critique/credit_oracle_shared", True),
         ("4. credit: the critics fitted at rest", "critique/credit_fit", False),
         ("4. credit: a critic started from a chain verifier", "critique/credit_verifier", False),
         ("5. stability study v3", "stability_v3", True))


def render_critique_costs() -> str:
    """What each experiment of issue 46 cost on this machine: its command's recorded time and, for
    a command of many runs, the sum of its runs' times (a command resumed part way read the runs
    it had finished back, so its own time can be the smaller). The rows marked False are
    diagnostics (or a shorter run of the same experiment), not the deliverables' main commands."""
    rows, total, main = [], 0.0, 0.0
    for what, path, core in COSTS:
        if not (RESULTS / path / "summary.json").exists():
            continue
        d = load(f"{path}/summary.json")
        # each run once (the credit comparison's seed 0 repeats its sweep's run)
        runs = sum({r.get("run", i): r.get("wall_s", 0) for i, r in enumerate(d.get("runs", []))}.values())
        spent = max(d["wall_s"], runs)
        total, main = total + spent, main + (spent if core else 0.0)
        commands = list(dict.fromkeys(part["command"] for part in d.get("parts") or [d]))  # seeds appended: each part's
        rows.append([what + ("" if core else " (a diagnostic)"), " then ".join(f"`{c}`" for c in commands),
                     minutes(d["wall_s"]), minutes(runs) if runs else "-"])
    return (table(["experiment", "command", "its recorded time", "its runs' time"], rows)
            + f"\nIn all about {total / 3600:.1f} h of one 2-core CPU machine (the larger of the two times each); the "
            f"deliverables' main commands, without the diagnostics, about {main / 3600:.1f} h.\n")


BLOCKS = {"critique-costs": render_critique_costs}
for _name, _fn, _file in (("critique-hacking", render_hacking, "hacking"), ("critique-overopt", render_overopt, "overopt"),
                          ("critique-retention-demo", lambda: render_retention("critique/retention_demo"), "retention_demo"),
                          ("critique-retention-smollm2", lambda: render_retention("critique/retention_smollm2"),
                           "retention_smollm2"),
                          ("critique-retention-smollm2-80", lambda: render_retention("critique/retention_smollm2_80"),
                           "retention_smollm2_80"), ("critique-credit-oracle", render_credit_oracle, "credit_oracle"),
                          ("critique-credit-verifier", render_credit_verifier, "credit_verifier"),
                          ("critique-credit-compare", render_credit_compare, "credit_compare"),
                          ("critique-credit-shared", lambda: render_credit_compare("critique/credit_shared"), "credit_shared"),
                          ("critique-credit-rm-probe", render_credit_rm_probe, "credit_rm_probe"),
                          ("critique-credit-fit", render_credit_fit, "credit_fit"),
                          ("critique-credit-warmstarts", render_credit_warmstarts, "credit_warmstarts")):
    if (RESULTS / "critique" / _file / "summary.json").exists():  # a block is added with its result file
        BLOCKS[_name] = _fn
# The critics' warm-up sweeps (stage 1 of `critique.py credit`): one block each, named by its folder.
for _file in ("credit_critics", "credit_critics_300", "credit_control", "credit_derivation", "credit_derivation_1000"):
    if (RESULTS / "critique" / _file / "summary.json").exists():
        BLOCKS["critique-" + _file.replace("_", "-")] = lambda _path=f"critique/{_file}": render_credit_critics(_path)
