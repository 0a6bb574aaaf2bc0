"""stability.md's second edition beyond the demo's main table: two updates per batch (results/stability_v2/),
Gemma 3 270M (results/stability_v2_gemma3/) and what the edition concludes. Helpers: stability_doc.py."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from figure_blocks import table
from figure_blocks.rl import _f, _rows, _span
from figure_blocks.stability_doc import (DEMO, GEMMA, LABELS, ONCE, SAME_RUN, SHORT, V2, _and, _lab, _seeds, _stat,
                                         _steps, _times, _word, _wrap)

# -- the second edition: two updates per batch -------------------------------------------------------------------

MU2 = ("grpo_mu2", "cispo_mu2")


def render_mu2_table() -> str:
    """stability.md "CISPO where it differs": the table, from results/stability_v2/summary.json and the runs'
    metrics.jsonl.gz (the largest importance ratio of each run)."""
    v, runs = _lab(V2)
    best = max(v[n]["eval_final"]["mean"] for n in MU2)
    rows = []
    for n in MU2:
        s, seeds = v[n], v[n]["seeds"]
        ratio = [max(r["policy/ratio_max"] for r in _steps(V2, n, k)) for k in seeds]
        rows.append([LABELS[n], _stat(s["eval_final"], bold=s["eval_final"]["mean"] == best),
                     " / ".join(f"{runs[n, k]['eval_final']:.3f}" for k in seeds), f"{s['pass_final']['mean']:.3f}",
                     f"{s['entropy_late']['mean']:.3f}", f"{min(ratio):.1f} to {max(ratio):.1f}",
                     f"{s['eval_max_drop']['mean']:.3f}", f"{s['wall_s']['mean']:.0f} s"])
    return table(["variant", "accuracy at step 300", "seed 0 / 1 / 2", "pass@4", "entropy, 2nd half", "ratio max",
                  "largest accuracy fall", "wall time"], rows)


def render_mu2_notes() -> str:
    """stability.md "CISPO where it differs": what the table shows, from results/stability_v2/summary.json and the
    runs' metrics.jsonl.gz (the k3 KL estimate of each step)."""
    v, runs = _lab(V2)
    seeds = v["grpo_mu2"]["seeds"]
    gaps = [runs["grpo_mu2", n]["eval_final"] - runs["cispo_mu2", n]["eval_final"] for n in seeds]
    ahead = "on every seed" if min(gaps) > 0 else f"on average ({_seeds([n for n, g in zip(seeds, gaps) if g > 0], 0)})"
    spikes, medians, fell = [], [], False
    for n in MU2:
        top = max((runs[n, k] for k in seeds), key=lambda r: r["kl_max"])
        steps = _steps(V2, n, top["seed"])
        at = max(steps, key=lambda r: r["kl/k3"])["step"]
        before = [a for s, a in top["eval_curve"] if s < at][-1]
        fell |= any(a < before for s, a in top["eval_curve"] if s > at)
        spikes.append(f"{top['kl_max']:.0f} for {SHORT[n].split(',')[0]} seed {top['seed']}")
        medians += [statistics.median(r["kl/k3"] for r in _steps(V2, n, k)) for k in seeds]
    mu1, mu2 = v["grpo"]["eval_final"]["mean"], v["grpo_mu2"]["eval_final"]["mean"]
    return (f"GRPO's clipped objective finished ahead {ahead} ({', '.join(f'{g:+.2f}' for g in gaps)}), and two "
            f"updates per\nbatch {'beat' if mu2 > mu1 else 'did not beat'} one at the same sampled tokens ({mu2:.3f} "
            f"against {mu1:.3f}). Both show single-step spikes of the\nk3 KL estimate (up to {_and(spikes)}, medians "
            f"{min(medians):.2f} to {max(medians):.2f}): one token\nwhose probability rose far above the reference's, "
            f"not a drift; accuracy {'fell' if fell else 'did not fall'} after them.\n")


# -- the second edition: Gemma 3 270M ----------------------------------------------------------------------------

G_ORDER = DEMO[:-1]


def render_gemma_setup() -> str:
    """stability.md "A real model": the runs' setup, their wall times and whether CISPO's run matched GRPO's,
    from results/stability_v2_gemma3/summary.json and the seed-0 GRPO and CISPO runs' metrics.jsonl.gz."""
    _, runs = _lab(GEMMA)
    minutes = [r["wall_s"] / 60 for r in runs.values()]
    a, b = (_rows(f"{GEMMA}/{n}_s0/metrics.jsonl.gz") for n in ("grpo", "cispo"))
    same = len(a) == len(b) and all(x.get(k) == y.get(k) for x, y in zip(a, b) for k in set(x) | set(y)
                                    if not k.startswith(SAME_RUN))
    return ("`configs/gemma3_270m_arith_cpu.yaml` (GGUF from PyPI, 3-shot prompt, 8 prompts x 8 samples, 12 new\n"
            f"tokens, lr 5e-6) for 12 steps instead of 80 (a run is {_span(minutes, '.0f')} minutes here), evaluation "
            "on all 50\nheld-out problems x 4 samples at steps 0 and 12, VAPO's warm-up 4 steps (so 8 policy updates).\n"
            "Seeds 0, 1, 2 for every objective but CISPO, which ran seed 0 only: at one update per batch it is GRPO's\n"
            f"gradient, and its run {'matched GRPO' if same else 'differed from GRPO'}'s"
            f"{' to the last digit' if same else ''}. Completion lengths differ by objective, so\n"
            "sampled tokens do too (every run sampled 768 completions). `benchmarks/results/stability_v2_gemma3/`.\n")


def render_gemma_table() -> str:
    """stability.md "A real model": the table, from results/stability_v2_gemma3/summary.json."""
    v, runs = _lab(GEMMA)
    start = " / ".join(f"{runs['grpo', k]['eval_start']:.3f}" for k in v["grpo"]["seeds"])
    rows = [[LABELS[n], str(len(s["seeds"])), _stat(s["eval_final"]),
             " / ".join(f"{runs[n, k]['eval_final']:.3f}" for k in s["seeds"]), f"{s['pass_final']['mean']:.2f}",
             f"{s['sampled_tokens']['mean']:,.0f}", f"{s['entropy_late']['mean']:.2f}",
             _stat(s["explained_variance_late"], ".2f", spread=False), f"{s['wall_s']['mean']:.0f} s"]
            for n, s in ((n, v[n]) for n in G_ORDER)]
    return table(["variant", "seeds", "accuracy at step 12, mean [min, max]", f"seed 0 / 1 / 2 (step 0: {start})",
                  "pass@4", "sampled tokens", "entropy, 2nd half", "critic EV, 2nd half", "wall time"], rows)


def _gemma_ranks(v: dict, runs: dict) -> dict:
    """Where PPO came last (of every objective) and VAPO first (of GRPO, PPO and VAPO), by seed, and the gaps to
    GRPO that held on every seed."""
    seeds = v["grpo"]["seeds"]
    f = {k: r["eval_final"] for k, r in runs.items()}
    last = [n for n in seeds if f["ppo", n] == min(f[o, n] for o in G_ORDER if (o, n) in f)]
    first = [n for n in seeds if f["vapo", n] == max(f[o, n] for o in ("grpo", "ppo", "vapo"))]
    held = [f"{SHORT[o]}'s {'lead' if f[o, seeds[0]] > f['grpo', seeds[0]] else 'deficit'}" for o in G_ORDER
            if o != "grpo" and len(v[o]["seeds"]) == len(seeds)
            and len({(f[o, n] > f["grpo", n]) - (f[o, n] < f["grpo", n]) for n in seeds}) == 1]
    vals = lambda o, ns: ", ".join(f"{f[o, n]:.3f}" for n in ns)  # noqa: E731
    if len(last) == len(seeds):
        ppo, ppo_last = f"on every seed ({vals('ppo', seeds)})", "last on every seed"
    else:
        beaten = "; ".join(f"on seed {n} its {f['ppo', n]:.3f} beat "
                           + _and(f"{SHORT[o]}'s {f[o, n]:.3f}" for o in G_ORDER if (o, n) in f and f[o, n] < f["ppo", n])
                           for n in seeds if n not in last)
        lowest = v["ppo"]["eval_final"]["mean"] == min(v[o]["eval_final"]["mean"] for o in G_ORDER)
        ppo = (f"on average ({v['ppo']['eval_final']['mean']:.3f}) and last on {_seeds(last, 0)} "
               f"({vals('ppo', last)}; {beaten})") if lowest else f"on {_seeds(last, 0)} ({vals('ppo', last)})"
        ppo_last = f"last on {_seeds(last, 0)}" + (" and lowest on average" if lowest else "")
    return dict(ppo=ppo, ppo_last=ppo_last, vapo_first=_seeds(first, len(seeds)),
                vapo_beat=_seeds([n for n in seeds if f["vapo", n] > f["grpo", n]], len(seeds)),
                vapo_vals=vals("vapo", seeds), grpo_vals=vals("grpo", seeds),
                held=f"only {_and(held)} over GRPO held on every seed" if held else "no gap to GRPO held on every seed")


_GEMMA_NOTES = """PPO with the linear head did worst {ppo}: on seed {worst} its reward stayed
at {reward} for {n_steps} steps while entropy rose to {entropy:.1f}; the head on the shared trunk (value-loss
gradients into the policy at the critic's learning rate of 1e-3) explained none of the return (EV
{ppo_ev} on average). VAPO did best of the three on {vapo_first} ({vapo_vals} against GRPO's
{grpo_vals}), yet its critic explained nothing either (EV {wu} at the warm-up's end, {late} after): with
values near the batch mean its advantages are the centred reward, so its lead comes from its other
parts, most likely the positive-example LM loss (its entropy fell to {vapo_ent:.2f} by step {last_step} on seed {ent_seed},
GRPO's to {grpo_ent:.2f}). This lab did not run the ablation that would say which part. Dr. GRPO ({dr:.3f}) and
DAPO ({dapo:.3f}, with {dapo_x} GRPO's sampled tokens) also finished above GRPO on average; with three
seeds and 200 held-out samples each, {held}.
"""


def render_gemma_notes() -> str:
    """stability.md "A real model": what the table shows, from results/stability_v2_gemma3/summary.json and the
    runs' metrics.jsonl.gz (PPO's worst run's rewards and entropy; VAPO's and GRPO's entropy at the last step)."""
    v, runs = _lab(GEMMA)
    ranks = _gemma_ranks(v, runs)
    worst = min((r for (n, _), r in runs.items() if n == "ppo"), key=lambda r: r["eval_final"])["seed"]
    ppo = _steps(GEMMA, "ppo", worst)
    ent_seed = v["vapo"]["seeds"][0]
    vapo, grpo = _steps(GEMMA, "vapo", ent_seed)[-1], _steps(GEMMA, "grpo", ent_seed)[-1]
    return _wrap(_GEMMA_NOTES.format(
        **{k: ranks[k] for k in ("ppo", "vapo_first", "vapo_vals", "grpo_vals", "held")}, worst=worst, ent_seed=ent_seed,
        reward=_span([r["reward/mean"] for r in ppo]), n_steps=len(ppo), entropy=max(r["policy/entropy"] for r in ppo),
        ppo_ev=_f(v["ppo"]["explained_variance_late"]["mean"]), wu=_f(v["vapo"]["explained_variance_warmup_end"]["mean"]),
        late=_f(v["vapo"]["explained_variance_late"]["mean"]), vapo_ent=vapo["policy/entropy"], last_step=vapo["step"],
        grpo_ent=grpo["policy/entropy"], dr=v["dr_grpo"]["eval_final"]["mean"], dapo=v["dapo"]["eval_final"]["mean"],
        dapo_x=_times(v["dapo"]["sampled_tokens"]["mean"] / v["grpo"]["sampled_tokens"]["mean"])))


_VERDICT = """\
- On the demo (3 seeds x 7 objectives, 300 steps) nothing was unstable: no collapse, no skipped
  update, no accuracy fall beyond the evaluation's noise, for the critic-free and the critic-based
  objectives alike. The seed moved the result {times_lo} to {times_hi} times more than the objective.
- A critic did not buy accuracy: PPO and both VAPOs finished within {gap:.2f} of GRPO on average, inside
  the seed-to-seed noise, at {cost_ppo:.1f}x (PPO) to {cost_rm:.1f}x (VAPO with a reward-model critic) the wall time.
- The critics themselves explained little of the return: {ev_ppo} (PPO's head), {ev_vapo} and {ev_rm} (VAPO's
  models) in the second half, 0.3 in no 10-step mean after the warm-up (at most {ev10:.2f}). On tasks
  whose outcome is settled by the last few tokens, the value of a prefix is the policy's own chance of
  success, which is what GRPO's group mean estimates from G samples without training anything.
- On the real model (3 seeds, 12 steps) the least stable objective was critic-based: PPO with a
  head on the shared trunk, {ppo_last} (one run barely learned). VAPO beat GRPO on {vapo_beat_head}
  {vapo_beat_tail}, but with a critic that explained none of the return: what helped was not the critic's
  value estimates (most likely its positive-example LM loss; not ablated here).
- What did move results: the token budget (DAPO's resampling: highest at the end, lowest at equal
  tokens) and reusing each batch (two clipped updates per batch beat one; CISPO's unclipped
  weighting lost to GRPO's clip there).
"""


def _ev10_max(lab: str, variants: tuple[str, ...], seeds: list[int]) -> float:
    """The largest 10-step mean of the critics' explained variance after the value warm-up, over the runs."""
    best = -math.inf
    for n in variants:
        for k in seeds:
            ev = [r["value/explained_variance"] for r in _steps(lab, n, k)
                  if "value/explained_variance" in r and r.get("value/warmup") != 1.0]
            best = max([best] + [statistics.mean(ev[i:i + 10]) for i in range(len(ev) - 9)])
    return best


def render_v2_verdict() -> str:
    """stability.md "What the second edition says": the bullets, from results/stability_v2/summary.json, the critics'
    runs' metrics.jsonl.gz (explained variance by step) and results/stability_v2_gemma3/summary.json."""
    v, runs = _lab(V2)
    seeds = v["grpo"]["seeds"]
    within = max(max(runs[o, n]["eval_final"] for o in ONCE) - min(runs[o, n]["eval_final"] for o in ONCE)
                 for n in seeds)
    # each objective's spread across seeds over the largest spread within a seed, floored ("at least so many times")
    times = [math.floor((v[n]["eval_final"]["max"] - v[n]["eval_final"]["min"]) / within) for n in DEMO]
    gap = max(abs(v[n]["eval_final"]["mean"] - v["grpo"]["eval_final"]["mean"]) for n in ("ppo", "vapo", "vapo_rm"))
    wall = lambda n: v[n]["wall_s"]["mean"] / v["grpo"]["wall_s"]["mean"]  # noqa: E731
    ranks = _gemma_ranks(*_lab(GEMMA))
    return _wrap(_VERDICT.format(
        times_lo=_word(min(times)), times_hi=_word(max(times)), gap=math.ceil(gap * 100) / 100, cost_ppo=wall("ppo"),
        cost_rm=wall("vapo_rm"), ev_ppo=_f(v["ppo"]["explained_variance_late"]["mean"]),
        ev_vapo=_f(v["vapo"]["explained_variance_late"]["mean"]), ev_rm=_f(v["vapo_rm"]["explained_variance_late"]["mean"]),
        ev10=_ev10_max(V2, ("ppo", "vapo", "vapo_rm"), seeds), ppo_last=ranks["ppo_last"],
        **dict(zip(("vapo_beat_head", "vapo_beat_tail"), ranks["vapo_beat"].rsplit(" ", 1)))))


BLOCKS: dict[str, Callable[[], str]] = {
    "stab-mu2-table": render_mu2_table,
    "stab-mu2-notes": render_mu2_notes,
    "stab-gemma-setup": render_gemma_setup,
    "stab-gemma-table": render_gemma_table,
    "stab-gemma-notes": render_gemma_notes,
    "stab-v2-verdict": render_v2_verdict,
}
