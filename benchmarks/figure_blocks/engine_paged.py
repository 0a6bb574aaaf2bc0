"""The paged engine's figures outside figures.py's three tables: RESULTS.md's "Paged engine (issue 42)" (its
run, the GPU and SmolLM2 notes, the targets, the TPU compile, "Multi-turn episodes on pages") and the docs pages'
"Multi-turn episodes with tools" sentence on it. Files: results/engine_paged/ (and results/engine/long_tail.json
for the day before).
"""

from __future__ import annotations

from collections.abc import Callable

from figure_blocks import evals, load, table
from figure_blocks.engine import _kv, _table, _x

GIB = 2**30


def _paged(name: str) -> dict:
    return load(f"engine_paged/{name}.json")


def render_paged_run() -> str:
    """RESULTS.md "Paged engine": the machine and its speed that day (engine_paged/long_tail.json against
    engine/long_tail.json, the day before)."""
    today, before = _paged("long_tail"), load("engine/long_tail.json")
    return ("`sampling.engine: paged` ([docs/sampling.md](../docs/sampling.md)): the continuous engine's slots over a pool of cache "
            "pages,\nadmission by free pages, preemption and recompute of the youngest sequence when the pool runs "
            "short.\n2026-12-03, this project's 2-core CPU machine (slower today than on 2026-12-02: the continuous "
            f"engine\ntook {today['engines']['continuous']['wall_s']:.1f} s on the long tail where it took "
            f"{before['engines']['continuous']['wall_s']:.1f} s then, so compare within a run), jax "
            f"{today['jax_version']}, {today['workload']['dtype']},\none device. JSON and PNGs: "
            "`results/engine_paged/`.\n")


def render_paged_pool() -> str:
    """RESULTS.md "Paged engine": the paged rollouts against the continuous engine's (engine_paged/long_tail.json)."""
    e = _paged("long_tail")["engines"]
    cont, paged = e["continuous"], e["paged"]
    same = "the same lengths" if cont["sequence_lengths"] == paged["sequence_lengths"] else "other lengths"
    return ("The paged engine's pool is the continuous engine's cache bytes (prompt blocks + slots x (M - 1)\n"
            "tokens), in whole pages. Its sampled rollouts are the continuous engine's token for token (the same\n"
            f"{paged['useful_tokens']:,} useful tokens, {same}), so the two divide the same work by their own times.\n")


def render_paged_gpu_notes() -> str:
    """RESULTS.md "Paged engine", below the GPU table (engine_paged/gpu/long_tail_gpu.json, long_tail.json)."""
    gpu, cpu = _paged("gpu/long_tail_gpu"), _paged("long_tail")
    e = gpu["engines"]
    return ("Where a decode step costs about the same at 50 or 100 rows, the paged engine's extra sequences in\n"
            f"flight ({e['paged']['concurrent_sequences']:.0f} against {e['continuous']['concurrent_sequences']:.0f}) "
            "turn into speed: it beats the continuous engine at equal bytes on the GPU,\nwhere on the CPU it ran at "
            f"{_x(cpu['ratios']['paged_vs_continuous'])}. It still falls short of issue 42's 1.5x over continuous\n"
            "and 3x over static. Two things hold it back. The gather path copies every slot's pages each step;\n"
            "the GPU paged kernel, not built, would read them in place. And with this tiny model, static\nwith every "
            f"row at once ({_kv(e['static_all']) / _kv(e['static_batched']):.0f}x the KV bytes) is the fastest of "
            "all: at that size nothing is bound by the\ncache. On fixed lengths the paged engine stays at static's "
            "speed (lock-step).\n")


def render_paged_smollm2_notes() -> str:
    """RESULTS.md "Paged engine", below the SmolLM2 table (engine_paged/{smollm2,long_tail}.json, the episodes'
    summary.json)."""
    d, tail = _paged("smollm2"), _paged("long_tail")["engines"]["paged"]
    e, r, fast = d["engines"], d["ratios"], d["ratios_by_fastest_call"]
    cont, paged = e["continuous"], e["paged"]
    differ = [i for i, (a, b) in enumerate(zip(cont["sequence_lengths"], paged["sequence_lengths"])) if a != b]
    half = load("engine_paged/tools_episodes/summary.json")["runs"]["paged_half_bytes"]["kv_cache_bytes_vs_continuous"]
    share = lambda x: f"{x['prefill_s']:.2f} of {x['wall_s']:.2f} s"  # noqa: E731
    return (f"- Paged / continuous **{_x(r['paged_vs_continuous'])}** ({_x(fast['paged_vs_continuous'])} by fastest "
            f"call), paged / static batched {_x(r['paged_vs_static_batched'])}, / static all\n  "
            f"{_x(r['paged_vs_static_all'])} (`ratios` in the file). As on the long tail: more sequences at once "
            f"({paged['concurrent_sequences']:.1f} against {cont['concurrent_sequences']:.1f}, {paged['draw_steps']}\n"
            f"  steps against {cont['draw_steps']}), but {paged['paging']['slots']} slots, half of them empty, each "
            "cost a CPU decode step its share.\n"
            f"- {len(cont['sequence_lengths']) - len(differ)} of the {len(cont['sequence_lengths'])} sequences have "
            f"the continuous engine's lengths; one (row {differ[0]}) drew another token\n  at one step: with a "
            f"{d['workload']['vocab_size']:,}-token vocabulary at temperature {d['workload']['temperature']:g}, fp32 "
            "attention summed in the page\n  gather's order instead of the slot block's moved one draw across a "
            "boundary. The tiny-model tests\n  (`tests/engine/test_paged.py`) are token-exact; a real vocabulary is "
            "not guaranteed to be.\n"
            "- Chunked prefill of newly admitted prompts: every prompt is prefilled once, up front, and shared by\n"
            f"  its G sequences, so an admitted sequence needs no prefill; the prefill is {share(paged)} here\n  "
            f"({paged['prefill_s'] / paged['wall_s']:.1%}) and {share(tail)} on the long tail "
            f"({tail['prefill_s'] / tail['wall_s']:.1%}). Moving it into decode steps would do the same\n"
            "  FLOPs on a CPU, so it cannot pay here; on a chip it would hide at most that share behind\n"
            "  weight-bound decode steps. Not built: recompute after preemption (replayed token by token) is\n"
            f"  where a chunked re-prefill would pay, and only on preemption-heavy pools (the {half:.2f}x-bytes\n"
            "  episodes below).\n")


def _targets_speed() -> str:
    """The first two targets: the long tail at equal bytes, and fixed lengths."""
    tail, fixed, loop = _paged("long_tail"), _paged("peers"), _paged("peers_page_loop")
    t, f, e = tail["ratios"], fixed["ratios"], tail["engines"]
    ms = {k: e[k]["wall_s"] * 1e3 / e[k]["slot_steps"] for k in ("paged", "continuous")}
    le, fe = loop["engines"], fixed["engines"]
    steps = le["paged"]["draw_steps"] / le["static_batched"]["draw_steps"]
    met = lambda ok: "met" if ok else "not met"  # noqa: E731
    return (f"- Long tail at equal bytes, paged >= 1.5x continuous: **{met(t['paged_vs_continuous'] >= 1.5)}, "
            f"{_x(t['paged_vs_continuous'])}** (and >= 3x static: {_x(t['paged_vs_static_batched'])}\n  static in "
            f"batches, {_x(t['paged_vs_static_all'])} static with every row at once). The paged engine does hold "
            "more sequences\n  at once "
            f"({e['paged']['concurrent_sequences']:.0f} against {e['continuous']['concurrent_sequences']:.0f}, in "
            f"{e['paged']['draw_steps']} steps against {e['continuous']['draw_steps']}), but on XLA:CPU a decode step "
            "costs in\n  proportion to its slots, so holding more of them saves nothing, and a slot-step of the paged\n"
            f"  engine costs {_x(ms['paged'] / ms['continuous'])} the slot engine's ({ms['paged']:.3f} against "
            f"{ms['continuous']:.3f} ms): its attention gathers each slot's\n"
            "  pages into one block every step (a copy of every attended key), where the slot engine reads its\n"
            "  own block in place. The gain the design is for comes where a decode step costs about the same at\n"
            "  50 or 100 rows (a chip reading the weights once per step: TPU, GPU), with the TPU kernel reading\n"
            "  pages where they lie; on a lent H200 the paged engine did beat the continuous one (\"On a GPU\" above).\n"
            f"- Fixed lengths, >= 0.95x static: **{met(f['paged_vs_static_batched'] >= 0.95)}, "
            f"{_x(f['paged_vs_static_batched'])}** static in batches ({_x(f['paged_vs_static_all'])} static all), "
            "and >= 5x\n  transformers' continuous batching: "
            f"**{met(f['paged_vs_transformers_cb'] >= 5)}, {f['paged_vs_transformers_cb']:.2f}x** (`generate_batch` "
            "sized for the workload; "
            f"{fe['paged']['useful_tokens_per_s'] / fe['transformers_cb_auto']['useful_tokens_per_s']:.1f}x\n"
            "  its own sizing). Here every sequence has a slot and the continuous engine's bytes hold every\n"
            "  sequence at max_new_tokens, so the paged engine runs the lock-step loop (`paged.lockstep_fits`),\n"
            "  with the same draws. Before that rule (file `peers_page_loop.json`, same day) the page loop ran\n"
            f"  it at {loop['ratios']['paged_vs_static_batched']:.2f}x static: a sequence's first page copies its "
            "prompt's partial last page, so M = 128 took\n  5 pages of 32, not 4, the pool held "
            f"{le['paged']['concurrent_sequences']:.0f} sequences on average, preempted "
            f"{le['paged']['paging']['preemptions']} and ran {'twice' if steps == 2 else f'{steps:g}x'} the steps.\n"
            f"  (`peers.json` records `pages_used_frac` {fe['paged']['paging']['pages_used_frac']:.1f} for the "
            "lock-step run: the code of that commit filled\n  it in for a loop that has no pages, not a measurement; "
            "the engine now reports no page figures there.)\n")


def _targets_default_step() -> str:
    """The last two targets: the default engine, and the whole GRPO step."""
    t, f = _paged("long_tail")["ratios"], _paged("peers")["ratios"]
    s, p = _paged("step_static_padded"), _paged("step_paged_packed")
    pair = lambda k: f"{p[k]:.2f} / {s[k]:.2f} s"  # noqa: E731
    return ("- Default: **`paged`** (from 2026-12-04; `static` before). The issue's rule, at least as fast as\n"
            f"  static on both workloads, holds in these runs: fixed lengths {_x(f['paged_vs_static_batched'])} "
            f"static in batches ({_x(f['paged_vs_static_all'])}\n  static all), long tail "
            f"{_x(t['paged_vs_static_batched'])} ({_x(t['paged_vs_static_all'])}); both from `peers.json` and "
            "`long_tail.json` above. With the\n  defaults (`slots: 0`, `kv_cache_bytes: 0`) it runs the lock-step "
            "loop (`paged.lockstep_fits`), the\n  fixed-length row above; what holds it back against `continuous` on "
            "the long tail on this machine\n"
            f"  ({_x(t['paged_vs_continuous'])}, above) is the per-slot cost of a CPU decode step, which a chip's "
            "figures should settle.\n  `engine: static` reproduces earlier runs bit for bit.\n"
            "- Whole GRPO step on the long-tailed config (16 prompts x 8, M 256, beta 0.04, 2 micro-batches),\n"
            "  paged engine + packed learner against static engine + padded learner, >= 1.5x: "
            f"**{_x(s['step_s_median'] / p['step_s_median'])}** by step\n  time ({p['step_s_median']:.2f} against "
            f"{s['step_s_median']:.2f} s: sampling {pair('sample_s_median')}, reference {pair('ref_s_median')}, "
            f"update {p['train_s_median']:.2f} /\n  {s['train_s_median']:.2f} s), "
            f"{_x(p['tokens_per_s'] / s['tokens_per_s'])} by useful tokens/s ({p['tokens_per_s']:.0f} against "
            f"{s['tokens_per_s']:.0f}; the two runs drew different lengths, mean\n  {p['completion_len_mean']:.1f} "
            f"and {s['completion_len_mean']:.1f}). Packing does most of it (the bins' fill is "
            f"{p['pack_fill_median']:.2f}); sampling gains "
            f"{_x(s['sample_s_median'] / p['sample_s_median'])}.\n")


def render_paged_targets() -> str:
    """RESULTS.md "Paged engine": the issue's targets (engine_paged/{long_tail,peers,peers_page_loop}.json,
    step_{static_padded,paged_packed}.json)."""
    return "Targets:\n" + _targets_speed() + _targets_default_step()


def render_paged_tpu() -> str:
    """RESULTS.md "Paged engine", the TPU compile of the 16k-token sampler (engine_paged/memory/*.json)."""
    static, paged = (_paged(f"memory/sampler_16k_{n}") for n in ("static", "paged"))
    st, pg = static["programs"]["sampler"], paged["programs"]["sampler"]
    refused = (f"refused: needs {st['required_bytes'] / GIB:.2f} GiB of {st['required_for']}, "
               f"{st['hbm_available_bytes'] / GIB:.2f} available")
    rows = [[f"static (every row reserves {static['workload']['completion_len']:,} tokens)",
             refused if not st["compiled"] else static["verdict"], f"{st['required_bytes'] / GIB:.2f} GiB",
             f">= {st['peak_bytes'] / GIB:.2f} GiB"],
            ["paged, 8 GiB pool per chip, 32 slots, pages of 64, decode attention by `ragged_paged_attention` "
             "(`auto` on TPU)", f"{paged['verdict']}, {paged['margin_frac']:.0%} margin",
             f"{pg['temp_bytes'] / GIB:.2f} GiB", f"{pg['peak_bytes'] / GIB:.2f} GiB"]]
    return (table(["engine", "XLA:TPU's verdict", "temporaries per chip", "peak per chip"], rows, "---|---|---:|---:")
            + "\nThe pool (1,170 page ids of 64 tokens x 28 layers per chip, 1,153 after the prompts': ~73.8k\n"
            "tokens) runs all 32 slots while\ntheir sequences average under ~2,300 tokens, and fewer, never failing, "
            "when they grow (a\n16,384-token sequence always finishes: the youngest are preempted for it). Compile: "
            f"{pg['compile_s']:.0f} s (static's\nrefusal: {st['compile_s']:.0f} s).\n")


_EPISODES = [("continuous", "continuous ({mib:.1f} MiB: every slot the whole capacity, `continuous_cache_bytes_approx`)"),
             ("paged_same_bytes", "paged, 0 (= continuous's reservation)"),
             ("paged_three_quarter_bytes", "paged, {mib:g} MiB ({vs:.2f}x)"), ("paged_half_bytes", "paged, {mib:g} MiB ({vs:.2f}x)")]


def render_tools_episodes() -> str:
    """RESULTS.md "Multi-turn episodes on pages": the table and what it shows (engine_paged/tools_episodes/:
    summary.json, each run's metrics.jsonl)."""
    d = load("engine_paged/tools_episodes/summary.json")
    runs, full = d["runs"], d["runs"]["continuous"]
    rows = []
    for key, label in _EPISODES:
        r = runs[key]
        first, last = (evals(f"engine_paged/tools_episodes/{r['dir']}/metrics.jsonl")[i]["eval/accuracy"] for i in (0, -1))
        ev = evals("engine_paged/tools_episodes/continuous/metrics.jsonl")
        both = " on both" if (first, last) == (ev[0]["eval/accuracy"], ev[-1]["eval/accuracy"]) else ""
        steps = (f"all {r['steps']} steps; eval {first:.3f} -> {last:.3f}{both}" if r["steps"] == full["steps"]
                 else f"{r['steps']} steps")
        paged = key != "continuous"
        rows.append([label.format(mib=(r["kv_cache_bytes"] or d["continuous_cache_bytes_approx"]) / 2**20,
                                  vs=r["kv_cache_bytes_vs_continuous"] or 1),
                     (("yes" if r["non_timing_metrics_equal_to_continuous"] else "no") + f" ({steps})") if paged else "",
                     f"{r['sample_s_median_first50']:.3f} s", _x(r["sample_s_vs_continuous"]),
                     f"{r['preemptions_per_step_first50']:g}" if paged else "",
                     f"{r['pages_used_frac_mean_first50']:.0%}" if paged else ""])
    head = ["engine, cache bytes", "every non-timing metric equal to continuous's",
            "sampling per step (median, steps 1-50)", "vs continuous", "preemptions per step", "pool held (mean)"]
    three, half = runs["paged_three_quarter_bytes"], runs["paged_half_bytes"]
    e = lambda v: f"{v:.1e}".replace("e-0", "e-")  # noqa: E731
    return (_table(head, rows, "---|---|---:|---:|---:|---:")
            + "\n- The episodes are token for token the continuous engine's: loss, rewards, KL, every eval figure\n"
            "  and sample are equal at every step; only `health/sampler_train_logprob_diff` differs, at fp32\n"
            f"  rounding (largest token {e(half['logprob_diff_token_max'])} paged, "
            f"{e(full['logprob_diff_token_max'])} continuous).\n"
            "- Paged sampling costs more here for the reasons of the long-tail figures above (a decode step's\n"
            "  cost grows with its slots on XLA:CPU, and the gather copies every attended key): at "
            f"{three['kv_cache_bytes_vs_continuous']:.2f}x the\n  bytes it runs {_x(three['sample_s_vs_continuous'])} "
            "the continuous engine's time with no preemption. At "
            f"{half['kv_cache_bytes_vs_continuous']:.2f}x the bytes every\n  step's 128 episodes grow past the pool "
            f"together: {half['preemptions_per_step_first50']:.0f} of them are preempted a step and replayed a\n"
            "  token per decode step. What would close it: a chip (where holding fewer bytes is the point and a\n"
            "  decode step's cost barely grows with its slots), recompute by chunked re-prefill instead of\n"
            "  replay, and an admission reserve that looks ahead at the growth of sequences in step.\n")


def render_tools_readme() -> str:
    """docs/environments.md: the paged engine on the calculator demo
    (engine_paged/tools_episodes/summary.json)."""
    runs = load("engine_paged/tools_episodes/summary.json")["runs"]
    three, half = runs["paged_three_quarter_bytes"], runs["paged_half_bytes"]
    return (f"(`configs/demo_cpu_tools.yaml`, {half['steps']} GRPO steps) trains to the same metrics, step for "
            "step, on\neither engine; on this CPU its sampling took "
            f"{_x(three['sample_s_vs_continuous'])} the continuous engine's time at "
            f"{three['kv_cache_bytes_vs_continuous']:.2f}x its cache\nbytes (no preemption) and "
            f"{_x(half['sample_s_vs_continuous'])} at {half['kv_cache_bytes_vs_continuous']:.2f}x "
            f"({half['preemptions_per_step_first50']:.0f} preemptions a step, each replayed a token per decode\n"
            "step) (\"Paged engine\" in `benchmarks/RESULTS.md`). `engine/preemptions` counts the preemptions.\n")


FOLD_RUNS = (("long_tail", "long tail (64 slots, 512 sequences, up to 256 tokens)"),
             ("fixed_length_slots16", "fixed 128 tokens, 16 slots (64 rows: refilled)"),
             ("fixed_length_slots64", "fixed 128 tokens, 64 slots (= rows: the lock-step loop)"))


def render_engine_fold() -> str:
    """RESULTS.md "Engines folded into one": the paged engine at the per-slot engine's settings
    against that engine, in one run per workload (engine_fold/*.json, at the commit before the fold)."""
    rows = ["| workload | per-slot engine: wall s (fastest) | paged, one reservation per slot: wall s (fastest) "
            "| useful tok/s ratio (median) | by the fastest calls | same tokens |", "|---|---|---|---|---|---|"]
    commits = set()
    for name, label in FOLD_RUNS:
        r = load(f"engine_fold/{name}.json")
        commits.add(r["source"]["commit"][:7])
        c, p = r["engines"]["continuous"], r["engines"]["paged_per_slot"]
        rows.append(f"| {label} | {c['wall_s']:.2f} ({min(c['wall_s_all']):.2f}) | {p['wall_s']:.2f} "
                    f"({min(p['wall_s_all']):.2f}) | {_x(r['paged_per_slot_vs_continuous'])} | "
                    f"{_x(r['paged_per_slot_vs_continuous_fastest'])} | {'yes' if r['same_tokens'] else 'no'} |")
    r = load(f"engine_fold/{FOLD_RUNS[0][0]}.json")
    return (f"Commit {', '.join(sorted(commits))} (the last with the per-slot engine's own loop), "
            f"{r['iters']} interleaved rounds after a first call, jax {r['jax_version']}, this project's 2-core "
            "CPU\nmachine (its times moved by a quarter between rounds of one run: compare within a row).\n\n"
            + "\n".join(rows) + "\n\n" + _fold_episodes())


def _fold_episodes() -> str:
    """The multi-turn line under the table (engine_fold/tools_episodes.json)."""
    e = load("engine_fold/tools_episodes.json")
    same = "the same metrics step for step" if e["other_metrics_equal"] else "other metrics"
    return (f"Multi-turn episodes (`configs/demo_cpu_tools.yaml`, `engine: continuous`, {len(e['sample_s_median_per_run'])} "
            f"runs of 12 steps, alternately by the tree before the fold and by {e['new_tree']}):\nsampling took "
            f"{e['sample_s_new']:.3f} s a step against {e['sample_s_old']:.3f} s ({_x(e['new_over_old'])}), with "
            f"{same} (`benchmarks/engine_fold_episodes.py`).\n")


BLOCKS: dict[str, Callable[[], str]] = {
    "engine-fold": render_engine_fold,
    "engine-paged-run": render_paged_run,
    "engine-paged-pool": render_paged_pool,
    "engine-paged-gpu-notes": render_paged_gpu_notes,
    "engine-paged-smollm2-notes": render_paged_smollm2_notes,
    "engine-paged-targets": render_paged_targets,
    "engine-paged-tpu": render_paged_tpu,
    "engine-tools-episodes": render_tools_episodes,
    "engine-tools-readme": render_tools_readme,
}
