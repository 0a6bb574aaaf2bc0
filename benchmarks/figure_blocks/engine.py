"""The rollout engines' figures: RESULTS.md's "Continuous engine (issue 27)" and the parts of "Paged engine
(issue 42)" outside figures.py's three tables (with "Multi-turn episodes on pages"), and the docs pages' sentences
on them ("Sampling", "Multi-turn episodes with tools"). Files: results/engine/ (c7fd8ed/: the runs before
323d990) and results/engine_paged/.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from figure_blocks import RESULTS, load, table


def _x(r: float) -> str:
    return f"{r:.2f}x"


def _pct(v: float) -> str:
    return "0%" if v == 0 else "100%" if v == 1 else f"{v:.1%}"


def _mib(b: int) -> str:
    return f"{b / 2**20:.0f}"


def _kv(e: dict) -> int | None:
    kv = e["kv_cache_bytes"]
    return kv["total"] if isinstance(kv, dict) else kv


def _bold(s: str, on: bool) -> str:
    return f"**{s}**" if on else s


def _table(head: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """figure_blocks.table with an empty cell written `| |`, as the docs write it."""
    text = table(head, rows, align)
    while "|  |" in text:
        text = text.replace("|  |", "| |")
    return text


# ---- Continuous engine (issue 27) ----

# (file under results/engine, workload, final engine?, prefill shown?, each engine's label in file order)
_RUNS = [("long_tail.json", "long tail, 64 slots", True, True,
          ["static batched (8 x 64 rows)", "static all (512 rows)", "continuous (64 slots)"]),
         ("long_tail_slots32.json", "long tail, 32 slots", False, True,
          ["static batched (16 x 32 rows)", "static all", "continuous (32 slots)"]),
         ("smollm2.json", "SmolLM2, seed 0", True, True,
          ["static batched (4 x 16 rows)", "static all (64 rows)", "continuous (16 slots)"]),
         ("smollm2_seed1.json", "SmolLM2, seed 1", False, True, ["static batched", "static all", "continuous"]),
         ("peers.json", "peers (fixed 128)", True, False,
          ["static batched (= static all at 64 slots)", "static all", "continuous (64 slots = rows: the lock-step loop)",
           "transformers `generate_batch`, sized: 64 requests per batch, 72 pages of 256",
           "transformers `generate_batch`, its own sizing", "transformers `generate` (64 rows)"])]


def _continuous_row(key: str, e: dict, label: str, final: bool, prefill: bool, above: dict | None) -> list[str]:
    ln, b = e["lengths"], final and key == "continuous"
    lengths = ("as above" if above and above["lengths"] == ln else str(ln["max"]) if ln["min"] == ln["max"]
               else f"{ln['mean']:.1f} / {ln['p50']:.0f} / {ln['p90']:.0f} / {_pct(ln['share_truncated'])}")
    util = e["slot_utilisation"]
    compile_s = ("" if key.startswith("transformers") else "0 (same program)" if e["compile_s"] == 0
                 else f"{e['compile_s']:.1f}")
    kv = _kv(e)
    return [_bold(label, b), _bold(f"{e['wall_s']:.2f} ({e['wall_s_min']:.2f})", b), f"{e['useful_tokens']:,}",
            _bold(f"{e['useful_tokens_per_s']:,.0f}", b), "" if util is None else _bold(_pct(util), b and util < 1),
            "" if e["draw_steps"] is None else f"{e['draw_steps']:,}",
            f"{e['prefill_s']:.3f}" if prefill and e["prefill_s"] is not None else "",
            "" if kv is None else _mib(kv), compile_s, lengths]


def render_continuous_table() -> str:
    """RESULTS.md "Continuous engine (issue 27)": the engines on each workload (results/engine/*.json)."""
    rows, previous = [], {}
    for name, workload, final, prefill, labels in _RUNS:
        data = load(f"engine/{name}")
        first = _bold(workload, True) if final else f"*{data['source']['commit'][:7]}* {workload}"
        for i, ((key, e), label) in enumerate(zip(data["engines"].items(), labels, strict=True)):
            rows.append([first if i == 0 else "", *_continuous_row(key, e, label, final, prefill, previous.get(key))])
        previous = data["engines"]
    p = load("engine/peers_prompt16.json")
    es = [p["engines"][k] for k in ("static_batched", "static_all", "continuous")]
    rows.append([f"*{p['source']['commit'][:7]}* peers, prompts of 16", "static batched / static all / continuous",
                 " / ".join(f"{e['wall_s']:.2f}" for e in es), f"{es[0]['useful_tokens']:,}",
                 " / ".join(f"{e['useful_tokens_per_s']:,.0f}" for e in es), _pct(es[0]["slot_utilisation"]),
                 str(es[0]["draw_steps"]), f"{es[0]['prefill_s']:.3f}", f"{_kv(es[0]) / 2**20:.1f}", "",
                 str(es[0]["lengths"]["max"])])
    head = ["workload", "engine", "wall s (fastest)", "useful tokens", "useful tok/s", "slot util.", "draw steps",
            "prefill s", "KV MiB", "compile s", "lengths mean / p50 / p90 / truncated"]
    return _table(head, rows)


def render_continuous_runs() -> str:
    """RESULTS.md "Continuous engine": the runs' versions and commits (results/engine/*.json)."""
    runs = {p.name: load(p) for p in sorted((RESULTS / "engine").glob("*.json")) if "source" in load(p)}
    peer, commit = runs["peers.json"]["peer"], runs["long_tail.json"]["source"]["commit"][:7]
    if any(d["source"]["engine_files_modified"] for d in runs.values()):
        raise SystemExit("results/engine: a run started with the engine's files modified; say so in RESULTS.md")
    edited = [(n, [f.split()[-1] for f in d["source_after"]["engine_files_modified"]]) for n, d in runs.items()
              if d["source_after"]["engine_files_modified"]]
    if len(edited) != 1:
        raise SystemExit("results/engine: RESULTS.md names the one run whose engine files changed during it")
    (name, files), = edited
    return ("2026-12-02, this project's 2-core CPU machine, shared with another engineer's test runs (hence\n"
            f"the interleaved rounds), jax {runs['long_tail.json']['jax_version']}, flax 0.12.8, torch "
            f"{peer['versions']['torch']} ({peer['torch_threads']} threads), transformers\n"
            f"{peer['versions']['transformers']}, float32, one device. Every JSON records the commit it ran and "
            "whether the engine's files\nwere modified before and after its run: unmodified before every run, and "
            "after every run but one\n(" + ", ".join(f"`{f}`" for f in files) + f", modified by the end of "
            f"`{name}`'s run). The rows in **bold** are the\nfinal engine ({commit}: the drain halving below, and "
            "the lock-step loop when every sequence has a\nslot); the fixed-length row ran at "
            f"{runs['peers.json']['source']['commit'][:7]} (449f601's engine, the same code on that\nworkload: it "
            f"takes the lock-step path, which {commit} did not change); the rows marked *c7fd8ed* are\nthe engine "
            "before both changes, kept for the workloads not re-run (its long-tail, SmolLM2 and\nfixed-length runs: "
            "`results/engine/c7fd8ed/`). JSON and PNGs: `results/engine/`; all workloads in one\nfigure: "
            "`results/engine/engines.png`.\n")


def render_continuous_lengths() -> str:
    """RESULTS.md "Continuous engine", the long-tailed workload: the three engines' lengths (long_tail.json)."""
    data = load("engine/long_tail.json")
    lengths = [n for e in data["engines"].values() for n in e["sequence_lengths"]]
    truncated = statistics.fmean(e["lengths"]["share_truncated"] for e in data["engines"].values())
    return ("10.4% reaching it (mean 101.8, p50 79, p90 256). Measured over the three engines' "
            f"{len(lengths):,}\nsequences: mean {statistics.fmean(lengths):.1f}, p50 {statistics.median(lengths):.0f}, "
            f"p90 {statistics.quantiles(lengths, n=10, method='inclusive')[8]:.0f}, {truncated:.1%} truncated at "
            f"{data['workload']['max_new_tokens']}.\n")


def render_continuous_notes() -> str:
    """RESULTS.md "Continuous engine": the draws and the KV bytes (long_tail.json, smollm2{,_seed1}.json)."""
    tail, smol, seed1 = (load(f"engine/{n}")["engines"] for n in ("long_tail.json", "smollm2.json", "smollm2_seed1.json"))
    static, static1 = ([d[k]["lengths"]["mean"] for k in ("static_batched", "static_all")] for d in (smol, seed1))
    generated = tail["continuous"]["kv_cache_bytes"]["generated"]
    return ("Each engine draws its own random numbers (the static engine one uniform per step for all rows,\n"
            "the continuous one per sequence), so their rollouts, and the useful tokens, differ; tokens/s\n"
            "divides each engine's tokens by its own time. On SmolLM2's seed 0 the continuous engine drew\n"
            f"longer completions (mean {smol['continuous']['lengths']['mean']:.0f} against {min(static):.0f}-"
            f"{max(static):.0f}), on seed 1 shorter ones ({seed1['continuous']['lengths']['mean']:.1f} against "
            f"{min(static1):.1f}-{max(static1):.1f}): the\ndifference moves both ways with the seed, and both "
            "engines' log-probs equal a teacher-forced pass\n(tests/engine/), so this is the draw, not a bias. "
            "The continuous engine holds "
            "every prompt's block beside its slots: at\nthe same generated budget its KV cache is larger than a "
            f"static batch's ({_mib(_kv(tail['continuous']))} against "
            f"{_mib(_kv(tail['static_batched']))} MiB on\nthe long tail, {_mib(_kv(smol['continuous']))} against "
            f"{_mib(_kv(smol['static_batched']))} MiB on SmolLM2); at the drain halving it also holds the "
            "half-width\ncopy of the generated blocks for a moment "
            f"(+{_mib(generated / 2)} MiB on the long tail: half its {_mib(generated)} MiB of\ngenerated blocks, "
            "computed from the shapes, not measured) while it moves the sequences in flight.\n")


def render_continuous_changes() -> str:
    """RESULTS.md "Continuous engine", what changed at 323d990 (results/engine/ against results/engine/c7fd8ed/)."""
    new, old = ({n: load(f"engine/{d}{n}.json") for n in ("long_tail", "smollm2", "peers")} for d in ("", "c7fd8ed/"))
    util = {n: (old[n]["engines"]["continuous"]["slot_utilisation"], new[n]["engines"]["continuous"]["slot_utilisation"])
            for n in ("long_tail", "smollm2")}
    fixed = [d["peers"]["ratios"]["continuous_vs_static_batched"] for d in (old, new)]
    calls = new["peers"]["engines"]["static_batched"]["wall_s_all"]
    return ("- *The drain.* Once every queue is empty and no shard has more than half its slots busy, the\n"
            "  sequences in flight move into half the slots (their generated blocks, positions and logits are\n"
            "  gathered once) and the loop goes on with a decode step half as wide. On 2 CPU cores a step's\n"
            "  cost is close to proportional to its slots (the long-tailed model, `python\n"
            "  benchmarks/engine_step_cost.py benchmarks/configs/engine_long_tail.yaml sampling.slots=64`, then\n"
            "  `=16`, prints a continuous step's cost at each width; not kept in a file), so the idle slots of the\n"
            f"  drain cost real time. Long tail: utilisation {_pct(util['long_tail'][0])} -> "
            f"{_pct(util['long_tail'][1])}, SmolLM2 {_pct(util['smollm2'][0])} -> {_pct(util['smollm2'][1])}. "
            "The cost is\n  compile time, since each width compiles its own decode step: SmolLM2's continuous "
            "compile went\n  from "
            f"{old['smollm2']['engines']['continuous']['compile_s']:.1f} s (c7fd8ed) to "
            f"{new['smollm2']['engines']['continuous']['compile_s']:.1f} s with one halving. A second halving "
            "(449f601, its runs not kept\n  in files) gained a little more utilisation for one more width to "
            "compile, so the engine halves\n  once, from 8 slots up.\n"
            "- *One slot per sequence.* With slots >= sequences nothing can be refilled; the engine then runs\n"
            "  the static engine's lock-step loop (`grpo_jax/engine/lockstep.py`) with each sequence's own\n"
            f"  uniforms: the rollout the slot loop draws, at the static loop's speed. Fixed length: {_x(fixed[0])} ->\n"
            f"  {_x(fixed[1])} (median; "
            f"{_x(new['peers']['ratios_by_fastest_call']['continuous_vs_static_batched'])} by the fastest calls, "
            "which on this shared machine move between rounds:\n  static in batches took "
            f"{min(calls):.2f}-{max(calls):.2f} s).\n")


def render_continuous_targets() -> str:
    """RESULTS.md "Continuous engine": the issue's targets (results/engine/*.json, c7fd8ed/long_tail.json)."""
    r = {n: load(f"engine/{n}.json") for n in ("long_tail", "long_tail_slots32", "smollm2", "smollm2_seed1", "peers",
                                               "peers_prompt16", "c7fd8ed/long_tail")}
    q = {n: d["ratios"] for n, d in r.items()}
    u = {n: _pct(d["engines"]["continuous"]["slot_utilisation"]) for n, d in r.items()}
    two, fixed = q["long_tail"]["continuous_vs_static_batched"], q["peers"]["continuous_vs_static_batched"]
    fast = r["peers"]["ratios_by_fastest_call"]["continuous_vs_static_batched"]
    above_all = min(q[n]["continuous_vs_static_all"] for n in ("long_tail", "smollm2"))
    peers = min(q["peers"]["continuous_vs_transformers_cb"], q["peers"]["continuous_vs_transformers_generate"])
    rows = [["long tail, same KV budget: continuous >= 2x static batched useful tok/s",
             f"{_x(two)} (64 slots; {_x(r['long_tail']['ratios_by_fastest_call']['continuous_vs_static_batched'])} "
             f"by the fastest calls); SmolLM2 {_x(q['smollm2']['continuous_vs_static_batched'])} (seed 0); before "
             f"323d990: {_x(q['long_tail_slots32']['continuous_vs_static_batched'])} (32 slots), SmolLM2 seed 1 "
             f"{_x(q['smollm2_seed1']['continuous_vs_static_batched'])}", "met" if two >= 2 else "**not met** (64 slots)"],
            ["slot utilisation >= 85%", f"{u['long_tail']} (64 slots), SmolLM2 {u['smollm2']}; before 323d990: "
             f"{u['c7fd8ed/long_tail']}, {u['long_tail_slots32']} (32 slots), SmolLM2 seed 1 {u['smollm2_seed1']}",
             "met" if min(r[n]["engines"]["continuous"]["slot_utilisation"] for n in ("long_tail", "smollm2")) >= 0.85
             else "**not met**"],
            ["not slower than static with every row at once", f"{_x(q['long_tail']['continuous_vs_static_all'])} "
             f"(64 slots), SmolLM2 {_x(q['smollm2']['continuous_vs_static_all'])}",
             "met" if above_all >= 1 else "**not met**"],
            ["fixed length: continuous >= 0.95x static", f"{_x(fixed)} (median), {_x(fast)} (fastest calls); "
             f"{_x(q['peers_prompt16']['continuous_vs_static_batched'])} with 16-token prompts (c7fd8ed)",
             ("met" if fast >= 0.95 else "met (median)") if fixed >= 0.95 else "**not met**"],
            [">= 2x transformers' continuous batching", f"{_x(q['peers']['continuous_vs_transformers_cb'])} (its "
             f"faster setting); {_x(q['peers']['continuous_vs_transformers_generate'])} its `generate`",
             "met" if peers >= 2 else "**not met**"]]
    return _table(["target", "measured", ""], rows)


def render_continuous_why() -> str:
    """RESULTS.md "Continuous engine": why the 2x is missed on the long tail (long_tail.json)."""
    e = load("engine/long_tail.json")["engines"]
    cont, static = e["continuous"]["slot_utilisation"], e["static_batched"]["slot_utilisation"]
    return (f"Why the 2x is missed on the long tail: utilisation is now {_pct(cont)} against the static batches' "
            f"{static:.0%}\n({cont / static:.1f}x fewer slot-steps per useful token), but the continuous engine's "
            "step costs more than a\nstatic batch's at the same rows, for two reasons. First, at equal rows and "
            "attended length one\nstep costs more than the static engine's (every slot reads its prompt's keys and "
            "values on its\nown, where the static engine reads each prompt once per group of G rows; `python\n"
            "benchmarks/engine_step_cost.py benchmarks/configs/peers.yaml sampling.slots=64` prints both, ms per\n"
            "step and phase, minimum of 3; its figures were not kept in a file). An earlier version of that\nscript "
            "left the static cache's earlier chunks unwritten, XLA folded them into one zero broadcast\nthat sat in "
            "the CPU's cache, and the static engine's later phases looked cheaper than they are\n(found in a profile: "
            "its attention matmuls read a `wrapped_broadcast`); the script now fills every\nchunk with random keys "
            "and values. Second, and larger: the continuous engine attends in the phase\nof the longest sequence in "
            "flight, and with 64 slots over a 10% tail there is nearly always one\npast 192 tokens, so most steps "
            "read all 256 generated slots of every slot, where a static batch\nclimbs through the phases and spends "
            "its early steps on short attention. What would close it:\nper-slot-group phases with slots regrouped by "
            "length (a slot gather every chunk of steps, like\nthe drain's), or a ragged attention kernel that reads "
            "each slot's own length (Pallas on TPU; on\nXLA:CPU only through masking).\n")


def render_continuous_step() -> str:
    """RESULTS.md "Continuous engine": the whole GRPO step with each engine (grpo_step_{static,continuous}.json)."""
    s, c = (load(f"engine/grpo_step_{n}.json") for n in ("static", "continuous"))
    rows = [[label, f"{d['step_s_median']:.2f}", f"{d['sample_s_median']:.2f}", f"{d['train_s_median']:.2f}",
             f"{d['tokens_per_s']:.0f}", f"{d['peak_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s"]
            for label, d in (("static (128 rows at once)", s), ("continuous (32 slots)", c))]
    share = sorted(d["train_s_median"] / d["step_s_median"] for d in (s, c))
    tokens = [round(d["tokens_per_s"] * d["step_s_median"]) for d in (c, s)]
    return _table(["engine", "step s (median)", "sampling s", "update s", "tokens/s", "matmul peak in the run"], rows) + (
        "\n(323d990; JSON: `results/engine/grpo_step_{static,continuous}.json`.) "
        f"{_x(s['step_s_median'] / c['step_s_median'])} the step, {_x(c['tokens_per_s'] / s['tokens_per_s'])} the\n"
        f"tokens/s: **not the 1.5x targeted**. On 2 CPU cores the update is {share[0] * 100:.0f}-{share[1]:.0%} of the "
        "step, so even a\nfree sampler could not make the step 1.5x faster, and the two engines draw different "
        "completions\n(the continuous run's three steps held "
        f"{tokens[0] / tokens[1] - 1:.0%} more tokens, {tokens[0]:,} against {tokens[1]:,} per step, which the\n"
        "update pays for). At c7fd8ed, in another run on the shared machine (its figures were not kept in\na file), "
        "the same commands put the continuous engine ahead: run to run these step times move by\nmore than the two "
        "engines differ here. The target belongs to a machine where decode is the larger\npart of the step (an "
        "accelerator decoding a long tail); here it cannot be shown.\n")


def render_continuous_readme() -> str:
    """docs/sampling.md, the continuous engine's figures (results/engine/{long_tail,smollm2}.json)."""
    tail, smol = (load(f"engine/{n}.json")["ratios"] for n in ("long_tail", "smollm2"))
    return (f"drew {_x(tail['continuous_vs_static_batched'])} (a long-tailed workload) and "
            f"{_x(smol['continuous_vs_static_batched'])} (SmolLM2 on word problems) the useful tokens/s of\nthe "
            f"static engine at the same budget, and {_x(tail['continuous_vs_static_all'])} / "
            f"{_x(smol['continuous_vs_static_all'])} the static engine with every row at once\n")


BLOCKS: dict[str, Callable[[], str]] = {
    "engine-continuous-runs": render_continuous_runs,
    "engine-continuous-lengths": render_continuous_lengths,
    "engine-continuous-table": render_continuous_table,
    "engine-continuous-notes": render_continuous_notes,
    "engine-continuous-changes": render_continuous_changes,
    "engine-continuous-targets": render_continuous_targets,
    "engine-continuous-why": render_continuous_why,
    "engine-continuous-step": render_continuous_step,
    "engine-continuous-readme": render_continuous_readme,
}
