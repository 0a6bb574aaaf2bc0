"""RL figures: the stability labs, on-policy distillation and the tool episodes.

RESULTS.md's sections "Stability lab" (both editions), "On-policy distillation on the demo" and
"Multi-turn episodes with tools", and the docs pages' paragraphs that quote the tool runs. Each block's
prose is a template below, filled from the result files by its render function. The pipelined runs'
figures: figure_blocks/rl_pipeline.py.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections.abc import Callable

from figure_blocks import RESULTS, load


def _rows(path: str) -> list[dict]:
    """A metrics file's rows (plain or gzipped JSON lines) under benchmarks/results/."""
    p = RESULTS / path
    text = gzip.open(p, "rt").read() if p.suffix == ".gz" else p.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _f(x: float, fmt: str = ".2f") -> str:
    """`x` formatted, without the sign of a value that rounds to zero."""
    s = format(x, fmt)
    return s.lstrip("-") if float(s.rstrip("%x")) == 0 else s


def _mmm(stat: dict) -> str:
    """A summary's {mean, min, max} as "mean [min, max]"."""
    return f"{stat['mean']:.3f} [{stat['min']:.3f}, {stat['max']:.3f}]"


def _span(values, fmt: str = ".2f", unit: str = "") -> str:
    """"lo-hi" (one figure when both round the same)."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def _row(cells) -> str:
    """A Markdown table row ("| |" for an empty cell)."""
    return re.sub(r"\|  (?=\|)", "| ", "| " + " | ".join(cells) + " |")


# -- the stability labs ----------------------------------------------------------------------------------------

_V2 = """\
`python benchmarks/stability.py` (the demo, 300 steps, 3 seeds each, equal sampled tokens; details,
commands and the plot: [stability.md](stability.md)), 2026-12-02, 2 CPU cores. Final held-out
accuracy, mean over seeds [min, max]: GRPO {grpo_mmm}, DAPO {dapo} (but {dapo_tok} at GRPO's
token budget: it sampled {dapo_x:.2f}x), Dr. GRPO {dr_grpo}, CISPO {cispo} (the same gradient as GRPO at one
update per batch), PPO with a head {ppo}, VAPO with a separate critic model {vapo}, VAPO with a
reward-model critic {vapo_rm}. With two updates per batch GRPO {grpo_mu2_mmm} against CISPO {cispo_mu2}
[{cispo_mu2_lo}, {cispo_mu2_hi}]. No run collapsed (largest accuracy fall between evaluations {fall:.3f}){skipped}. Critic explained variance in the second half: PPO {ev_ppo}, VAPO {ev_vapo}, VAPO-RM {ev_vapo_rm}; at the
end of the 50-step value warm-up {wu_vapo} and {wu_vapo_rm}: **the target of 0.3 after warm-up is not met**
(why, and what was tried: stability.md). Gemma 3 270M (12 steps, 3 seeds, from about {g_start:.2f}):
GRPO {g_grpo_mmm}, PPO with a head {g_ppo_mmm} ({g_ppo_rank}), VAPO {g_vapo}
[{g_vapo_lo}, {g_vapo_hi}] (first of the three on every seed, with a critic that explained nothing: EV {g_ev});
DAPO {g_dapo} ({g_dapo_x:.0f}x the tokens), Dr. GRPO {g_dr_grpo}, CISPO (seed 0) {g_cispo} (= GRPO). Every seed:
stability.md.
"""


def render_stability_v2() -> str:
    """RESULTS.md "Stability lab, second edition": its paragraph, from results/stability_v2/summary.json (the demo)
    and results/stability_v2_gemma3/summary.json (Gemma 3 270M)."""
    s, gs = load("stability_v2/summary.json"), load("stability_v2_gemma3/summary.json")
    out = {}
    for prefix, v in (("", s["variants"]), ("g_", gs["variants"])):
        for name, stat in v.items():
            e = stat["eval_final"]
            out[prefix + name], out[prefix + name + "_mmm"] = f"{e['mean']:.3f}", _mmm(e)
            out[f"{prefix}{name}_lo"], out[f"{prefix}{name}_hi"] = f"{e['min']:.3f}", f"{e['max']:.3f}"
        out[prefix + "dapo_x"] = v["dapo"]["sampled_tokens"]["mean"] / v["grpo"]["sampled_tokens"]["mean"]
    v, g = s["variants"], gs["variants"]
    skipped = sum(r["skipped_steps"] for r in s["runs"])
    out.update(dapo_tok=f"{v['dapo']['eval_at_tokens']['mean']:.3f}", fall=max(r["eval_max_drop"] for r in s["runs"]),
               skipped=" or\nskipped an update" if not skipped else f";\n{skipped:.0f} updates were skipped in all",
               g_start=statistics.mean(r["eval_start"] for r in gs["runs"]),
               g_ev=_f(g["vapo"]["explained_variance_late"]["mean"]),
               **{f"ev_{n}": _f(v[n]["explained_variance_late"]["mean"]) for n in ("ppo", "vapo", "vapo_rm")},
               **{f"wu_{n}": _f(v[n]["explained_variance_warmup_end"]["mean"], ".3f") for n in ("vapo", "vapo_rm")})
    final = {(r["variant"], r["seed"]): r["eval_final"] for r in gs["runs"]}
    seeds = sorted({n for _, n in final})
    last = [n for n in seeds if final["ppo", n] == min(x for (_, m), x in final.items() if m == n)]
    lowest = g["ppo"]["eval_final"]["mean"] == min(stat["eval_final"]["mean"] for stat in g.values())
    out["g_ppo_rank"] = ("last on every seed" if last == seeds else
                         f"last on seed{'s' * (len(last) > 1)} {' and '.join(map(str, last))}"
                         + (", lowest on average" if lowest else ""))
    return _V2.format(**out)


_V1 = """\
`python benchmarks/stability.py` (15 demo runs, 3 seeds each, equal sampled tokens), 2026-12-01, 2
CPU cores. Final held-out accuracy, mean over seeds [min, max]: GRPO {grpo}, Dr. GRPO
{dr_grpo}, RLOO {rloo}, PPO {ppo} (critic explained
variance {ev}), coin-flip rewards {grpo_random} from {start:.3f} at step 0. Gradient noise scale
{noise} rows of a 256-row batch for all four; dead groups {dead:.0%} observed against {expected} expected from
the pass rate. The seed (the warm start) moves accuracy {times} times more than the algorithm. Details,
the plot and what it shows: [stability.md](stability.md).
"""


def render_stability_v1() -> str:
    """RESULTS.md "Stability lab: GRPO, Dr. GRPO, RLOO, PPO and a random-reward control": its paragraph, from
    results/stability/summary.json."""
    s = load("stability/summary.json")
    v, algos = s["variants"], ("grpo", "dr_grpo", "rloo", "ppo")
    final = {(r["variant"], r["seed"]): r["eval_final"] for r in s["runs"]}
    seeds = v["grpo"]["seeds"]
    spread = lambda xs: max(xs) - min(xs)  # noqa: E731
    by_seed = statistics.mean(spread([final[a, n] for n in seeds]) for a in algos)
    by_algo = statistics.mean(spread([final[a, n] for a in algos]) for n in seeds)
    return _V1.format(
        **{name: _mmm(v[name]["eval_final"]) for name in (*algos, "grpo_random")},
        ev=_f(v["ppo"]["explained_variance_late"]["mean"], ".3f"),
        start=statistics.mean(r["eval_start"] for r in s["runs"] if r["variant"] == "grpo_random"),
        noise=_span([round(r["grad_noise_scale"], -1) for r in s["runs"] if r["variant"] in algos], ".0f"),
        dead=statistics.mean(v[a]["frac_zero_std"]["mean"] for a in algos),
        expected=_span([100 * v[a]["frac_zero_std_expected"]["mean"] for a in algos], ".0f", "%"),
        times=f"{by_seed / by_algo:.0f}")


# -- on-policy distillation ------------------------------------------------------------------------------------

_DISTILL = """\
The demo's GRPO run (seed 0, {steps} steps, held-out accuracy {t0:.3f} -> {t1:.3f}) exported as the teacher;
students from the demo's warm start with seeds 0, 1, 2 (`configs/demo_cpu_distill.yaml`: the same
prompts, G, token cap and steps as GRPO, beta 0), against the stability lab's GRPO runs of the same
seeds at the same steps and sampled tokens ({tokens} each). Commands: the config's header;
`benchmarks/results/distill/` (teacher, students, logs). 2026-12-02, 2 CPU cores.

| seed | warm start | GRPO alone, step {steps} | distillation, step {steps} | distillation + reward (`distill.reward_coef: 1`) \
| held-out reverse KL to the teacher, step 0 -> {steps} (distillation) |
|---|---|---|---|---|---|
{rows}

The student moves towards the teacher every time (its held-out reverse KL falls {kl_fall}), and from
the teacher's own warm start it reaches the teacher's level as fast as GRPO did ({d0:.3f} and {m0:.3f}
against GRPO's {g0:.3f} and the teacher's {t1:.3f}). From other warm starts it does not: {behind} behind
GRPO, and {behind_mix} behind with the reward mixed in. Here the teacher is itself a {t1:.2f} policy at
temperature 1 trained from one particular warm start, so matching it is not the same as solving the
task; distillation's case (a much stronger teacher, long answers where a per-token signal is worth
more than one reward) is not what this demo can show.
"""


def render_distill() -> str:
    """RESULTS.md "On-policy distillation on the demo": the whole section's text, from results/distill/
    ({teacher,student_s*,mix_s*}_metrics.jsonl.gz) and the GRPO runs in results/stability_v2/summary.json."""
    runs = {}
    for name in ["teacher"] + [f"{k}_s{n}" for k in ("student", "mix") for n in range(3)]:
        rows = _rows(f"distill/{name}_metrics.jsonl.gz")
        runs[name] = ([r for r in rows if "eval/accuracy" in r], sum(r.get("perf/sample_tokens", 0) for r in rows))
    grpo = {r["seed"]: r for r in load("stability_v2/summary.json")["runs"] if r["variant"] == "grpo"}
    acc = lambda name, i=-1: runs[name][0][i]["eval/accuracy"]  # noqa: E731
    kl = lambda n, i: runs[f"student_s{n}"][0][i]["eval/distill_reverse_kl"]  # noqa: E731
    lines, cols = [], []
    for n in range(3):
        cols.append([acc(f"student_s{n}", 0), grpo[n]["eval_final"], acc(f"student_s{n}"), acc(f"mix_s{n}")])
        label = f"{n} (the teacher's own warm start)" if n == 0 else str(n)
        lines.append((label, cols[-1], f"{kl(n, 0):.3f} -> {kl(n, -1):.3f}"))
    lines.append(("mean", [statistics.mean(c) for c in zip(*cols)], ""))
    rows = [_row([label, f"{c[0]:.3f}"] + [f"**{x:.3f}**" if x == max(c[1:]) else f"{x:.3f}" for x in c[1:]] + [k])
            for label, c, k in lines]
    tokens = [t for _, t in runs.values()] + [r["sampled_tokens"] for r in grpo.values()]
    steps = runs["teacher"][0][-1]["step"]
    return _DISTILL.format(
        steps=steps, t0=acc("teacher", 0), t1=acc("teacher"), rows="\n".join(rows),
        tokens=f"{statistics.mean(tokens) / 1e3:.0f}k",
        kl_fall=_span([100 * (1 - kl(n, -1) / kl(n, 0)) for n in range(3)], ".0f", "%"),
        d0=cols[0][2], m0=cols[0][3], g0=cols[0][1],
        behind=_span([c[1] - c[2] for c in cols[1:]]), behind_mix=_span([c[1] - c[3] for c in cols[1:]]))


# -- multi-turn episodes with tools ----------------------------------------------------------------------------

def _e(x: float, digits: int) -> str:
    """`x` in the docs' short exponent form: 5e-8, 2.4e-5."""
    return f"{x:.{digits}e}".replace("e-0", "e-")


def _tool_run(name: str) -> dict:
    """One run of results/tools/NAME/metrics.jsonl: its evaluations and training steps, and figures over the steps
    (first and last 10; medians of the steps after the first, which compiles)."""
    rows = _rows(f"tools/{name}/metrics.jsonl")
    evals, steps = [r for r in rows if "eval/accuracy" in r], [r for r in rows if "reward/mean" in r]
    mean = lambda key, rs=steps: statistics.mean(r.get(key, 0) for r in rs)  # noqa: E731
    ends = lambda key, fmt: f"{mean(key, steps[:10]):{fmt}} -> {mean(key, steps[-10:]):{fmt}}"  # noqa: E731
    median = lambda key: statistics.median(r[key] for r in steps[1:])  # noqa: E731
    return {"evals": evals, "acc": [r["eval/accuracy"] for r in evals], "steps": steps, "mean": mean, "ends": ends,
            "eval_steps": " -> ".join(str(r["step"]) for r in evals), "step_s": median("perf/step_s"),
            "sample_s": median("perf/sample_s"), "samples": evals[0]["eval/prompts"] * evals[0]["eval/k"],
            "acc_chain": " -> ".join(f"{r['eval/accuracy']:.3f}" for r in evals),
            "pass": f"{evals[0]['eval/pass@k']:.3f} -> {evals[-1]['eval/pass@k']:.3f}",
            "diff": max(r["health/sampler_train_logprob_diff"] for r in steps),
            "diff_max": max(r["health/sampler_train_logprob_diff_max"] for r in steps)}


_ARITH = """\
| | with the calculator | without |
|---|---|---|
| warm start (200 steps) | worked episodes: `<calc>{{prompt}}</calc>`, the calculator's answer, `{{answer}}` | the answer |
| held-out accuracy, step {steps} | **{acc}** | **{acc_no}** |
| pass@4, step 0 -> {last} | {pass_} | {pass_no} |
| train reward, first 10 -> last 10 steps | {reward} | {reward_no} |
| tool calls per episode | {calls} | |
| model / environment tokens per episode (last 10 steps) | {model_tok:.1f} / {env_tok:.1f} | |
| episodes truncated | {truncated} | |
| `health/sampler_train_logprob_diff` (mean per token; largest token) | {diff} at most; {diff_max} | {diff_no}; \
{diff_max_no} |
| step (median; sampling) | {step:.2f} s ({sample:.2f} s) (the rerun with the final code, whose files are in \
results/tools/tools; every non-timing metric of every step equals the first run's, which shared the cores with tests) \
| {step_no:.2f} s ({sample_no:.2f} s) |

Without the tool the model writes numbers of the right length with the wrong digits
("6422*8260" -> 588151408; it is 53045720), never one right in {samples:.0f} held-out samples, so GRPO has no
signal. With it, the warm start leaves mostly copying errors (the tool call's operands copied
wrong: "5339+6590" called as 5339+5590), and GRPO removes {removed:.0%} of them.
"""


def _removed(acc: list[float]) -> float:
    """The share of the warm start's held-out errors that GRPO removed."""
    return (acc[-1] - acc[0]) / (1 - acc[0])


def render_tools_arith() -> str:
    """RESULTS.md "Multi-turn episodes with tools": the tiny char model's table and what it shows, from
    results/tools/{tools,no_tools}/metrics.jsonl."""
    t, n = _tool_run("tools"), _tool_run("no_tools")
    last10 = t["steps"][-10:]
    return _ARITH.format(
        steps=t["eval_steps"], acc=t["acc_chain"], acc_no=n["acc_chain"], last=t["evals"][-1]["step"],
        pass_=t["pass"], pass_no=n["pass"], reward=t["ends"]("reward/mean", ".3f"),
        reward_no=n["ends"]("reward/mean", ".3f"), calls=t["ends"]("env/tool_calls_mean", ".2f"),
        model_tok=t["mean"]("completion/model_tokens_mean", last10), env_tok=t["mean"]("completion/env_tokens_mean", last10),
        truncated=t["ends"]("completion/truncated_frac", ".1%"), diff=_e(t["diff"], 0), diff_max=_e(t["diff_max"], 1),
        diff_no=_e(n["diff"], 1), diff_max_no=_e(n["diff_max"], 1), step=t["step_s"], sample=t["sample_s"],
        step_no=n["step_s"], sample_no=n["sample_s"], samples=n["samples"], removed=_removed(t["acc"]))


_SMOL = """\
| | with the calculator | without |
|---|---|---|
| warm start (30 steps, same rows) | worked episodes: `<calculator>{{expression}}</calculator>`, the answer, \
`The answer is {{answer}}.` | `{{expression}} = {{answer}}. The answer is {{answer}}.` |
| held-out accuracy, step {steps} | **{acc}** | **{acc_no}** |
| pass@4, step {steps} | {pass_} | {pass_no} |
| train reward, first 10 -> last 10 steps | {reward} | {reward_no} |
| tool calls per episode | {calls} | |
| step (median; sampling) | {step:.1f} s ({sample:.1f} s) | {step_no:.1f} s ({sample_no:.1f} s) |

Before any warm start, prompted with a description of the tag, SmolLM2 seldom called the tool (a
probe whose figures no result file keeps; its held-out accuracy with the usual prompt is {real:.3f}, section
"Real models"): the format had to be taught. After the warm start the calculator does the
arithmetic and the model copies the expression out of the story; one_step problems leave GRPO
nothing to fix ({t0:.2f} at step 0). Without the tool, the same warm start teaches the format and the
one-line computation, and the model's own arithmetic is what fails ("18 + 11 = 39", "39 * 5 = 175");
{grpo_steps} GRPO steps move it from {n0:.2f} to {n1:.2f}. So with tools SmolLM2 ends {gain:.2f} above its no-tool run of
the same length, and all of that gain comes from the warm start teaching it to call the calculator,
not from GRPO. The with-tool step costs {cost:.0f}x the no-tool one ({step:.1f} s against {step_no:.1f} s): each episode is
two turns and a trajectory of ~{tok:.0f} tokens against ~{tok_no:.0f}, and the update runs over the 80-token
trajectory capacity.
"""


def render_tools_smol() -> str:
    """RESULTS.md "Multi-turn episodes with tools": SmolLM2's table and what it shows, from
    results/tools/{smol_tools,smol_no_tools}/metrics.jsonl and results/real_models/smollm2/metrics.jsonl."""
    t, n = _tool_run("smol_tools"), _tool_run("smol_no_tools")
    calls = t["ends"]("env/tool_calls_mean", ".2f")
    real = [r for r in _rows("real_models/smollm2/metrics.jsonl") if "eval/accuracy" in r][0]["eval/accuracy"]
    return _SMOL.format(
        steps=t["eval_steps"], acc=t["acc_chain"], acc_no=n["acc_chain"], pass_=t["pass"], pass_no=n["pass"],
        reward=t["ends"]("reward/mean", ".3f"), reward_no=n["ends"]("reward/mean", ".3f"),
        calls=calls.split(" -> ")[0] if len(set(calls.split(" -> "))) == 1 else calls,
        step=t["step_s"], sample=t["sample_s"], step_no=n["step_s"], sample_no=n["sample_s"], real=real,
        t0=t["acc"][0], n0=n["acc"][0], n1=n["acc"][-1], grpo_steps=n["evals"][-1]["step"],
        gain=t["acc"][-1] - n["acc"][-1], cost=t["step_s"] / n["step_s"],
        tok=t["mean"]("completion/model_tokens_mean") + t["mean"]("completion/env_tokens_mean"),
        tok_no=n["mean"]("completion/len_mean"))


# -- the docs pages' sentences ------------------------------------------------------------------------------------

def render_readme_tools() -> str:
    """docs/environments.md: what the tool demos show, after their table, from
    results/tools/{tools,smol_tools,smol_no_tools}/metrics.jsonl."""
    arith, smol, smol_no = (_tool_run(n)["acc"] for n in ("tools", "smol_tools", "smol_no_tools"))
    return ("The tiny model cannot add or multiply 4-digit numbers itself; with the calculator it learns to copy\n"
            f"the operands into the call and the result out of it, and GRPO removes {_removed(arith):.0%} of its "
            f"copying errors.\nSmolLM2 gains {smol[-1] - smol_no[-1]:.2f} from the tool, all of it from the warm start "
            "that teaches the call (GRPO has\nnothing left to fix on one-operation problems); without it, its own "
            "arithmetic fails.\n")


_LOGPROB = """\
Tokens are exact. The model's tokens stay as it sampled them; the environment's messages become
the tokens the chat template adds after the model's text: the difference between rendering the
conversation with and without them (the rest of the model's turn as the template closes it, the
messages, the next generation prompt). Where a template breaks that (a thinking template that drops
earlier `<think>` blocks once a user message follows, one that trims the model's text), the
sampled tokens are kept and only the new messages are rendered, after a neutral user/assistant
exchange, so the trajectory never re-tokenises what the model wrote; the model then sees the
history as sampled rather than as a fresh render would show it. The trainer recomputes the
log-probs of exactly those sequences: `health/sampler_train_logprob_diff` stays at fp32 rounding
(1e-7 in the tests, at most {diff} in the tool demo) on multi-turn runs. Metrics: `env/turns_mean`,
`env/tool_calls_mean`, `env/errors`, `env/time_s`, `completion/model_tokens_mean`,
`completion/env_tokens_mean`, `env/template_fallbacks` (episodes that needed the fallback above),
`env/parks`; `samples.jsonl` records each episode's turns.
"""


def render_readme_logprob() -> str:
    """docs/environments.md: the paragraph on exact tokens, with the sampler-trainer log-prob
    gap of the tool demo (its largest per-step mean) from results/tools/tools/metrics.jsonl."""
    return _LOGPROB.format(diff=_e(_tool_run("tools")["diff"], 0))


BLOCKS: dict[str, Callable[[], str]] = {
    "rl-stability-v2": render_stability_v2,
    "rl-stability-v1": render_stability_v1,
    "rl-distill": render_distill,
    "rl-tools-arith": render_tools_arith,
    "rl-tools-smol": render_tools_smol,
    "rl-readme-tools": render_readme_tools,
    "rl-readme-logprob": render_readme_logprob,
}
