"""The reward-model figures: docs/data.md "Reward models and LLM judges" and RESULTS.md "Reward model
trained on preference pairs", from benchmarks/results/reward_model/.

Each of the runs in its own folder (`demo_4layer/`: configs/rm_demo_cpu.yaml; `lm_2layer/`: the same
with 2 layers, 1000 steps, wrong and padded pairs, constant lr) holds train-rm's `rm_metrics.jsonl`
and `rm_config.yaml`, `near_misses.json` (benchmarks/rm_near_misses.py on its model), the GRPO run
on that model alone (`grpo_metrics.jsonl`, `grpo_config.yaml`, `grpo_samples.jsonl`) and `run.json`
(date, commit, commands, seconds). The three top-level metrics files are the first, 2-layer
Bradley-Terry-only runs (2026-12-01).
"""

from __future__ import annotations

import statistics

from figure_blocks import load, metrics, minutes, table

RM = "reward_model"


def _pair_evals(path: str) -> list[dict]:
    return [r for r in metrics(f"{RM}/{path}") if "rm/pair_accuracy" in r]


def _at(evals: list[dict], step: int) -> dict:
    return next(r for r in evals if r["step"] == step)


def _kinds(row: dict) -> str:
    """'0.998 (wrong 1.00, digit 0.994)': the held-out pairs, then per kind of rejected answer but padding."""
    kinds = sorted(k.rsplit("/", 1)[1] for k in row if k.startswith("rm/pair_accuracy/") and not k.endswith("verbose"))
    return f"{row['rm/pair_accuracy']:.3f} (" + ", ".join(f"{k} {row[f'rm/pair_accuracy/{k}']:.3f}" for k in kinds) + ")"


def _off_by_ten(run: str) -> str:
    ranked = load(f"{RM}/{run}/near_misses.json")["ranked_right"]
    tens = [v for k, v in ranked.items() if k.endswith("10")]
    return f"{min(tens):.2f}-{max(tens):.2f}"


def _grpo(run: str) -> tuple[dict, dict]:
    """The first and last held-out evaluations of the GRPO run on `run`'s reward model."""
    rows = [r for r in metrics(f"{RM}/{run}/grpo_metrics.jsonl") if "eval/verifier_accuracy" in r]
    return rows[0], rows[-1]


def render_results_first() -> str:
    """RESULTS.md: the first reward model (2 layers, Bradley-Terry only) and the two longer runs."""
    evals = _pair_evals("rm_demo_cpu_metrics.jsonl")
    steps = [r["perf/step_s"] for r in metrics(f"{RM}/rm_demo_cpu_metrics.jsonl") if "perf/step_s" in r]
    cols = [0, 100, 300, evals[-1]["step"]]
    row = lambda label, key: [label] + [f"{_at(evals, s)[key]:.3f}" for s in cols]  # noqa: E731
    body = [row("all (`rm/pair_accuracy`)", "rm/pair_accuracy"), row("verbose rejected", "rm/pair_accuracy/verbose"),
            row("wrong rejected", "rm/pair_accuracy/wrong")]
    body[0][-1] = f"**{body[0][-1]}**"
    wrong, both = _pair_evals("wrong_only_1500_steps_metrics.jsonl"), _pair_evals("both_kinds_1000_steps_metrics.jsonl")
    w = {r["step"]: r["rm/pair_accuracy/wrong"] for r in wrong}
    return (f"The first demo reward model (2026-12-01, 2 CPU cores shared with a SmolLM2 run): the demo policy's "
            "shape (2 layers,\nhidden 128, char tokenizer) with a score head, Bradley-Terry only on "
            "`arithmetic_preferences` (6000\ntrain / 500 held-out pairs, \"37+48=\" with the right plain answer against "
            "a wrong one, off by 1-10,\nor the right one in filler), batch 64, lr 1e-3, "
            f"{cols[-1]} steps: **{minutes(sum(steps))}** of steps, {statistics.median(steps):.2f} s a step (median).\n\n"
            + table(["held-out pairs", *(f"step {s}" if s == 0 else str(s) for s in cols)], body)
            + "\nIt learns \"plain beats padded\" within 100 steps and, in this budget, not to add: wrong sums stay at\n"
            "chance. Two longer runs (`--set train.steps=1500 --set train.learning_rate=0.002`) show where\n"
            f"arithmetic starts: with wrong pairs only, wrong-pair accuracy went {w[0]:.2f} -> {w[750]:.2f} (750 steps) "
            f"->\n{w[1000]:.2f} (1000 steps, then {w[1500]:.2f} at 1500); with both kinds it was still "
            f"{_at(both, 1000)['rm/pair_accuracy/wrong']:.2f} at 1000 steps (half the pairs\nteach it). Metrics: "
            "`results/reward_model/*_metrics.jsonl`.\n")


BLOCKS = {"rm-results-first": render_results_first}


def _label(run: str) -> str:
    """'4 layers + `lm_coef: 1`, `digit` pairs, 2000 steps, cosine', from the run's train-rm config."""
    import yaml

    from figure_blocks import RESULTS

    c = yaml.safe_load((RESULTS / RM / run / "rm_config.yaml").read_text())
    t, kinds = c["train"], c["data"]["builder_kwargs"]["kinds"]
    return (f"{c['model']['architecture']['num_layers']} layers + `lm_coef: {t['lm_coef']:g}`, "
            + ("`digit` pairs, " if "digit" in kinds else "") + f"{t['steps']} steps"
            + (", cosine" if t["lr_schedule"] == "cosine" else ""))


def _slips(run: str, last: int = 3) -> str:
    """Up to `last` answers off by -10 in the GRPO run's logged samples, latest first: '94+63=147'."""
    out = []
    for s in reversed(metrics(f"{RM}/{run}/grpo_samples.jsonl")):
        a, b = map(int, s["prompt"].rstrip("=").split("+"))
        if s["completion"].isdigit() and int(s["completion"]) == a + b - 10 and len(out) < last:
            out.append(f"{s['prompt']}{s['completion']}")
    return ", ".join(out)


def render_readme_table() -> str:
    """docs/data.md: the reward models, their pair and near-miss accuracy, and GRPO on each alone (verifier accuracy)."""
    first = _pair_evals("rm_demo_cpu_metrics.jsonl")[-1]
    rows = [[f"2 layers, Bradley-Terry only, {first['step']} steps (2026-12-01)", _kinds(first), "not measured",
             "not run (it ranks style only)"]]
    for run in ("lm_2layer", "demo_4layer"):
        start, end = _grpo(run)
        label = _label(run) + (" (`configs/rm_demo_cpu.yaml`)" if run == "demo_4layer" else "")
        rows.append([label, _kinds(_pair_evals(f"{run}/rm_metrics.jsonl")[-1]), _off_by_ten(run),
                     f"{start['eval/verifier_accuracy']:.3f} -> {end['eval/verifier_accuracy']:.3f}"])
    run = load(f"{RM}/demo_4layer/run.json")
    demo = [r for r in metrics("demo_cpu/metrics.jsonl") if "eval/accuracy" in r]
    s2, e2 = _grpo("lm_2layer")
    return ("**A reward model's pair accuracy is not enough: measure it on the policy's own mistakes.** GRPO on\n"
            f"the demo's reward model alone (no verifier in the reward; the commands are in "
            f"`configs/rm_demo_cpu.yaml`), {end['step']} GRPO steps\nfrom the demo's warm start, measured "
            f"{run['date']} on 2 cores (`benchmarks/results/reward_model/`):\n\n"
            + table(["reward model (train-rm)", "held-out pairs", "off by 10 ranked right", "GRPO on it: verifier accuracy"],
                    rows)
            + f"\nFrom the same warm start the verifier-trained demo went {demo[0]['eval/accuracy']:.3f} -> "
            f"{demo[-1]['eval/accuracy']:.3f} (`benchmarks/results/demo_cpu/`). The 2-layer\nmodel's blind spot is "
            "the tens digit: its score, read at the last token, cannot see the digits the earlier\nlayers predict "
            "(that takes a third layer), so it ranks an answer off by 10 at about chance (400\nrandom sums, each "
            "against sum +- 10), and the policy, whose warm-started mistakes are mostly slipped carries, learns\n"
            f"slipped answers (samples.jsonl: {_slips('lm_2layer')}) while the reward model's held-out score\n"
            f"climbs ({s2['eval/reward_mean']:.2f} -> {e2['eval/reward_mean']:.2f}).\n")


BLOCKS["rm-readme-table"] = render_readme_table


def render_results_now() -> str:
    """RESULTS.md: the two reward models of 2026-12-04 (demo_4layer, lm_2layer): held-out pairs by step and
    kind, near misses, and GRPO on each alone."""
    lines = []
    for run in ("demo_4layer", "lm_2layer"):
        info, evals = load(f"{RM}/{run}/run.json"), _pair_evals(f"{run}/rm_metrics.jsonl")
        kinds = sorted(k.rsplit("/", 1)[1] for k in evals[-1] if k.startswith("rm/pair_accuracy/"))
        steps = [r["perf/step_s"] for r in metrics(f"{RM}/{run}/rm_metrics.jsonl") if "perf/step_s" in r]
        near = load(f"{RM}/{run}/near_misses.json")["ranked_right"]
        start, end = _grpo(run)
        lines += [f"**{_label(run)}** (`{RM}/{run}/`; `{info['commands'][0]}`): {minutes(info['train_rm_s'])} in all, "
                  f"{statistics.median(steps):.2f} s a step (median).\n\n",
                  table(["held-out pairs", *(str(r["step"]) for r in evals)],
                        [["all", *(f"{r['rm/pair_accuracy']:.3f}" for r in evals)]]
                        + [[f"{k} rejected", *(f"{r[f'rm/pair_accuracy/{k}']:.3f}" for r in evals)] for k in kinds]),
                  "\nThe right sum ranked above a near miss (`benchmarks/rm_near_misses.py`, 400 random sums, by whether "
                  "the sum carries and the miss): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in near.items()) + ".\n"
                  f"GRPO on it alone ({end['step']} steps of the demo): held-out verifier accuracy "
                  f"{start['eval/verifier_accuracy']:.3f} -> {end['eval/verifier_accuracy']:.3f}, its own held-out "
                  f"score {start['eval/reward_mean']:.2f} -> {end['eval/reward_mean']:.2f}, "
                  f"`health/verifier_disagreement` {end['health/verifier_disagreement']:.2f} at the end.\n\n"]
    return "".join(lines).rstrip("\n") + "\n"


BLOCKS["rm-results-now"] = render_results_now
