"""RESULTS.md's "Reasoning lengths" (issue 41) and "Memory of the pod configs" (issue 26) sections, and
the docs pages' long-sequence and pod memory figures, written from results/attention, results/packing,
results/memory_length, results/memory_tpu and results/memory_qwen3_*.json.

The memory tables keep their hand-written layout; every figure in them is read from a file, and a
word that states what a file shows ("refused", "none", a length that fits) follows from the file or
is checked against it (`_claim`): a file that no longer agrees stops the script.
"""

from __future__ import annotations

import re
import statistics

from figure_blocks import RESULTS, load, table

GIB = 2**30
MARGIN = 0.3  # the memory tables' "fits with a 30% margin": peak <= 70% of HBM
Q06 = "qwen3-0.6b_v5e-8_"  # what "~" stands for in a memory_length file's name
OFF = "_auto_remat-offload"


def _ml(name: str) -> dict:
    """memory_length/NAME.json's train step, GiB per chip: pk (peak, or what a refusal needed), tmp
    (temporaries, or the refusal's figure), host (offloaded), ok (compiled), m (margin, share of HBM), k (length in k)."""
    d = load(f"memory_length/{name.replace('~', Q06)}.json")
    p = d["programs"]["train_step"]
    return {"pk": p["peak_bytes"] / GIB, "tmp": p.get("temp_bytes", p.get("required_bytes", 0)) / GIB,
            "host": p.get("host_temp_bytes", 0) / GIB, "ok": p.get("compiled", True), "m": d["margin_frac"],
            "k": d["workload"]["completion_len"] // 1024}


def _table(head: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """`table`, with an empty cell written '| |' as the docs have it."""
    return re.sub(r"\|  (?=\|)", "| ", table(head, rows, align))


def pk(name: str) -> str:
    return f"{_ml(name)['pk']:.2f}"


def host(name: str) -> str:
    return f"{_ml(name)['host']:.2f}"


def tmp(name: str) -> str:
    f = _ml(name)
    return f"{f['tmp']:.2f}" if f["ok"] else f"refused, {f['tmp']:.2f}"


def verdict(name: str) -> str:
    m = _ml(name)["m"]
    return f"fits, margin {m:.0%}" if m >= MARGIN else f"fits the chip, margin {m:.0%}" if m >= 0 else "does not fit"


def _claim(name: str, word: str) -> str:
    """`word` as the doc says it of memory_length/NAME.json, once the file is checked to say so too."""
    f = _ml(name)
    if not {"refused": not f["ok"], "fits": f["ok"] and f["m"] >= 0, "met": f["m"] >= MARGIN}[word]:
        raise SystemExit(f"benchmarks/figure_blocks/lengths.py: the doc says {word!r} of memory_length/"
                         f"{name.replace('~', Q06)}.json and the file disagrees: rewrite that sentence")
    return word


def _head(name: str, extra: str = "", bold: bool = False, how: str = "") -> str:
    """A fit-table cell: '4k{how} (peak; extra)' when the length fits with the margin, else 'none (4k: peak)'."""
    f = _ml(name)
    if f["m"] < MARGIN:
        return f"none ({f['k']}k: {pk(name)})"
    label = f"**{f['k']}k**" if bold else f"{f['k']}k"
    return f"{label}{how} ({pk(name)}{'; ' + extra if extra else ''})"


def _e(x: float) -> str:
    """3.3e-06 -> 3.3e-6."""
    mantissa, exp = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exp)}"


def render_attention() -> str:
    """RESULTS "Attention by length (CPU)": the table and the 4k target (results/attention/cpu.json)."""
    rows = load("attention/cpu.json")["rows"]
    best = [r["chunked"][str(r["best_block"])] for r in rows]
    body = [[f"{r['tokens']:,}", f"{r['xla_s']:.3f}", f"{r['round3_xla_s']:.3f}", f"{b['s']:.3f}, {r['best_block']}",
             f"{b['speedup_vs_xla']:.2f}x", f"{b['speedup_vs_round3_xla']:.2f}x", f"{b['max_abs_diff']:.1e}"]
            for r, b in zip(rows, best)]
    top = best[max(range(len(rows)), key=lambda i: rows[i]["tokens"])]
    met = "met" if top["speedup_vs_xla"] >= 1 else "not met"
    return (table(["tokens", "xla (s)", "round 3's xla (s)", "chunked (s), block", "chunked vs xla", "vs round 3",
                   "max diff"], body, "|".join(["---:"] * 7))
            + "\nTarget \"chunked attention on CPU at 4k tokens no slower than today's XLA attention at equal\n"
            f"results\": {met}, {top['speedup_vs_round3_xla']:.1f}x faster than round 3's and "
            f"{top['speedup_vs_xla']:.1f}x than today's XLA path, outputs and gradients\n"
            f"within {_e(top['max_abs_diff'])}. `model.attention: auto` on CPU therefore runs XLA up to 256 key "
            "slots and chunked\n(256-token blocks) above (`models.dispatch.AUTO_XLA_MAX_KEYS`, `models.layers.CHUNK_BLOCK`). The "
            "chunked path's\ncompiled temporaries grow with T x block, not T^2 (tests/models/test_attention.py checks "
            "it at\n2,048 tokens against an O(T^2) bound that the XLA path exceeds).\n")


# The packing pairs: file tag -> the row's label (the machine's state is the runner's note).
PAIRS = {"_2026-12-03a": "`_2026-12-03a` (another engineer's compiles on the cores)",
         "": "(no tag; quiet machine)", "_2026-12-03c": "`_2026-12-03c` (quiet machine)"}
STEP_PARTS = ("step_s_median", "ref_s_median", "train_s_median")


def _pairs() -> list[tuple[str, dict, dict]]:
    return [(tag, load(f"packing/packing_false{tag}.json"), load(f"packing/packing_true{tag}.json")) for tag in PAIRS]


def render_packing_table() -> str:
    """RESULTS "Sequence packing on a long-tailed GRPO step": a row per pair of runs
    (results/packing/packing_{false,true}[_TAG].json); the untagged pair's (the commands' files) in bold."""
    rows = []
    for tag, pad, pack in _pairs():
        ratio = {k: f"{pad[k] / pack[k]:.2f}x" for k in STEP_PARTS}
        if not tag:
            ratio["step_s_median"] = f"**{ratio['step_s_median']}**"
            ratio["train_s_median"] = f"**{ratio['train_s_median']}**"
        tok = (f"{pack['train_tokens_per_s_median'] / pad['train_tokens_per_s_median']:.2f}x"
               if pad.get("train_tokens_per_s_median") else "")
        rows.append([PAIRS[tag], *(" / ".join(f"{d[k]:.2f}" for k in STEP_PARTS) for d in (pad, pack)),
                     f"{pad['peak_matmul_flops_per_s'] / 1e9:.0f} / {pack['peak_matmul_flops_per_s'] / 1e9:.0f}",
                     *ratio.values(), tok])
    return _table(["pair", "unpacked: step / ref / update (s)", "packed: step / ref / update (s)",
                  "matmul peak, unpacked / packed (GFLOP/s)", "step", "reference", "update", "useful tokens/s"],
                 rows, "---|---|---|---:|---:|---:|---:|---:")


def render_packing_targets() -> str:
    """RESULTS "Sequence packing": the targets against the pairs (results/packing/*.json); the bins' fill and
    the token slots it saves from the untagged packed run (pack_fill_median, completion_len_mean)."""
    pairs = _pairs()
    update = sorted(pad["train_s_median"] / pack["train_s_median"] for _, pad, pack in pairs)
    step = sorted(pad["step_s_median"] / pack["step_s_median"] for _, pad, pack in pairs)
    packed = sorted(pack["train_s_median"] for _, _, pack in pairs)
    run = load("packing/packing_true.json")
    fill, padding = run["pack_fill_median"], run["workload"]["completion_len"] / run["completion_len_mean"]
    met = "met" if update[0] >= 2 and step[0] >= 1.4 else "**not met on this machine**"
    n = {2: "two", 3: "three", 4: "four"}.get(len(pairs), str(len(pairs)))
    return (f"Targets: {met}. The update's throughput (useful tokens per second) >= 2x:\n"
            f"{update[0]:.2f}-{update[-1]:.2f}x over {n} pairs; the whole step >= 1.4x: {step[0]:.2f}-{step[-1]:.2f}x. "
            "The pairs disagree by more than\nthe target's margin: the same packed update measured "
            f"{', '.join(f'{s:.2f}' for s in packed[:-1])} and {packed[-1]:.2f} s. The\nbins' fill "
            f"(`perf/pack_fill`, real tokens / slots) is {fill:.2f}: the packed passes hold ~{padding * fill:.1f}x "
            "fewer\ntoken slots than the padded rows, but the update gains "
            f"{statistics.median(update):.1f}x, so the packed micro-step spends more\n"
            "per slot (the bin layout's scatters and the log-probs' gathers back to rows; attention with parent\n"
            "segments inside 320-token bins, chunked on CPU). A profile of the packed micro-step, a layout without\n"
            "the row scatters, and interleaved pairs (noise averaged within one run) are what would settle it.\n")


def render_memory_fit() -> str:
    """RESULTS "Memory per length": the longest completion each model fits with a 30% margin on v5e-8,
    v5e-32 and v5p-8 (results/memory_length/MODEL_SLICE_TOKENS_*.json)."""
    q17, ll = "qwen3-1.7b_v5e-8_", "llama3.2-1b_v5e-8_"
    rows = [["Qwen3-0.6B", "v5e-8", _head("~4096_before", f"8k {_claim('~8192_before', 'refused')}, {pk('~8192_before')}"),
             _head("~4096_auto", f"8k {pk('~8192_auto')}"),
             f"{_head('~16384' + OFF, host('~16384' + OFF) + ' host', bold=True)}; 32k {pk('~32768' + OFF)}"],
            ["Qwen3-1.7B", "v5e-8", _head(q17 + "4096_before"), _head(q17 + "4096_auto"),
             _head(q17 + "4096" + OFF, f"8k {pk(q17 + '8192' + OFF)}, 16k {pk(q17 + '16384' + OFF)}", bold=True)],
            ["Llama-3.2-1B", "v5e-8", _head(ll + "4096_before"), _head(ll + "4096_auto"),
             _head(ll + "4096" + OFF, f"{host(ll + '4096' + OFF)} host; 8k {pk(ll + '8192' + OFF)}, "
                   f"16k {pk(ll + '16384' + OFF)}", bold=True)]]
    q, q17, ll = "qwen3-0.6b_v5e-32_", "qwen3-1.7b_v5e-32_", "llama3.2-1b_v5e-32_"
    rows += [["Qwen3-0.6B", "v5e-32", _head(q + "4096_before"), "",
              (f"{_head(q + '16384' + OFF, host(q + '16384' + OFF) + ' host', bold=True)}; 32k "
               f"{_claim(q + '32768' + OFF, 'fits')} the chip ({pk(q + '32768' + OFF)})")],
             ["Qwen3-1.7B", "v5e-32", _head(q17 + "4096_before"), "",
              (f"{_head(q17 + '8192' + OFF, host(q17 + '8192' + OFF) + ' host', bold=True)}; 16k "
               f"{pk(q17 + '16384' + OFF)}, 32k {pk(q17 + '32768' + OFF)}")],
             ["Llama-3.2-1B", "v5e-32", _head(ll + "4096_before"), "",
              (f"{_head(ll + '8192' + OFF, host(ll + '8192' + OFF) + ' host', bold=True)}; 16k "
               f"{pk(ll + '16384' + OFF)}, 32k {_claim(ll + '32768' + OFF, 'refused')} ({pk(ll + '32768' + OFF)})")]]
    q, q17, ll = "qwen3-0.6b_v5p-8_", "qwen3-1.7b_v5p-8_", "llama3.2-1b_v5p-8_"
    rows += [["Qwen3-0.6B", "v5p-8 (95 GiB)", _head(q + "4096_xla", f"8k {pk(q + '8192_xla')}, margin "
                                                f"{_ml(q + '8192_xla')['m']:.1%}", how=" with today's xla attention"),
              _head(q + "32768_auto", bold=True), ""],
             ["Qwen3-1.7B", "v5p-8", _head(q17 + "4096_xla", f"8k {pk(q17 + '8192_xla')}", how=", xla"),
              f"{_head(q17 + '16384_auto', bold=True)}; 32k {pk(q17 + '32768_auto')}", ""],
             ["Llama-3.2-1B", "v5p-8", _head(ll + "4096_xla", f"8k {_claim(ll + '8192_xla', 'refused')}", how=", xla"),
              f"{_head(ll + '16384_auto', bold=True)}; 32k {pk(ll + '32768_auto')}", ""]]
    return _table(["model", "slice", "e1d5465 (before)", "new, remat block",
                  "new, remat offload (peak; host memory per chip)"], rows)


# The per-length table: (tokens, rows per chip per micro-batch, the verdict with its files).
PER_LENGTH = [(4096, 8, lambda: f"block: {verdict('~4096_auto')}"),
              (8192, 8, lambda: f"offload: {verdict('~8192' + OFF)}"),
              (16384, 8, lambda: f"offload: **{verdict('~16384' + OFF)}**; block: {verdict('~16384_auto')}"),
              (32768, 8, lambda: verdict("~32768" + OFF)),
              (16384, 2, lambda: f"block: {verdict('~16384_auto_2rows')}"),
              (16384, 1, lambda: verdict("~16384_auto_1row")),
              (32768, 1, lambda: verdict("~32768_auto_1row"))]


def render_memory_per_length() -> str:
    """RESULTS "Memory per length": the v5e-8 config's Qwen3-0.6B step per length and rows per chip per
    micro-batch (results/memory_length/qwen3-0.6b_v5e-8_*.json); an empty cell has no file."""
    def cell(name: str, peak: bool = True) -> str:
        if not (RESULTS / "memory_length" / f"{name.replace('~', Q06)}.json").exists():
            return ""
        return f"{tmp(name)} ({pk(name)})" if peak and _ml(name)["ok"] else tmp(name)

    rows = []
    for tokens, n, say in PER_LENGTH:
        rows_tag = {8: "", 1: "_1row"}.get(n, f"_{n}rows")
        off = cell(f"~{tokens}{OFF}{rows_tag}")
        rows.append([f"{tokens:,}", str(n), cell(f"~{tokens}_xla{rows_tag}", peak=False),
                     cell(f"~{tokens}_auto{rows_tag}"), f"**{off}**" if (tokens, n) == (16384, 8) else off, say()])
    return _table(["tokens", "rows", "xla: temps", "auto, remat block: temps (peak)", "auto, remat offload: temps (peak)",
                  f"verdict (30% margin: peak <= {16 * (1 - MARGIN):.1f})"], rows, "---:|---:|---:|---:|---:|---")


def render_memory_notes() -> str:
    """RESULTS "Memory per length": the fit and linearity targets and the notes under the table
    (results/memory_length/*.json, memory_length/before_fix/*.json)."""
    fit, uf = "~16384" + OFF, "before_fix/~16384_auto_unchunked-mlp"
    t = {name: _ml(name)["tmp"] for name in ("~8192_auto", "~16384_auto", "~8192" + OFF, fit, "~8192_xla", "~16384_xla",
                                             "qwen3-0.6b_cpu-8_8192_auto", "qwen3-0.6b_cpu-8_16384_auto")}
    lin = {"block": t["~16384_auto"] / t["~8192_auto"], "offload": t[fit] / t["~8192" + OFF]}
    more = "more" if _ml("~16384_auto_remat-attention")["tmp"] > t["~16384_auto"] else "no more"
    return (f"- **Fit target** (Qwen3-0.6B at 16k, 8 rows per chip per micro-batch, v5e 2x4, 30% margin): "
            f"**{_claim(fit, 'met')}\n  with `model.remat: offload`**: {pk(fit)} GiB per chip ({_ml(fit)['m']:.0%} "
            f"margin), {host(fit)} GiB of host memory per chip\n  (a v5e host has 4 chips: {4 * _ml(fit)['host']:.0f} "
            "GiB of its RAM). What it took: the 28 saved layer inputs (7.0 GiB in\n  HBM under `block`, `bf16[28, 8, "
            "16384, 1024]` in XLA:TPU's buffer report) moved to host memory,\n  and the MLP run in rematerialised "
            "chunks of 4,096 tokens of sequence (its `[131072, 3072]` bf16\n  intermediates, 768 MiB each and several "
            "live in a layer's backward pass, now a quarter of that):\n"
            f"  block alone went {tmp(uf)} -> {tmp('~16384_auto')} GiB of temporaries from the chunked MLP, offload "
            f"{tmp('before_fix/~16384' + OFF + '_unchunked-mlp')} -> {tmp(fit)}\n"
            "  (the unchunked figures: `before_fix/*_unchunked-mlp.json`).\n"
            "- **Linearity target** (temporaries at 16k <= 2.3x those at 8k): "
            f"{'met' if max(lin.values()) <= 2.3 else 'not met'}. XLA:TPU remat block {t['~16384_auto']:.2f} /\n"
            f"  {t['~8192_auto']:.2f} = {lin['block']:.2f}x, offload {t[fit]:.2f} / {t['~8192' + OFF]:.2f} = "
            f"{lin['offload']:.2f}x; host devices (XLA:CPU, `--devices 8`, block) "
            f"{t['qwen3-0.6b_cpu-8_16384_auto']:.2f} /\n  {t['qwen3-0.6b_cpu-8_8192_auto']:.2f} = "
            f"{t['qwen3-0.6b_cpu-8_16384_auto'] / t['qwen3-0.6b_cpu-8_8192_auto']:.2f}x; today's XLA attention "
            f"{t['~16384_xla']:.2f} / {t['~8192_xla']:.2f} = {t['~16384_xla'] / t['~8192_xla']:.1f}x.\n"
            "- The 4k row and the 1- and 2-row rows were measured at 32188ec (before the MLP chunking, which\n"
            "  changes nothing below 4,096 tokens of sequence); every other figure at this commit.\n"
            "- `before_fix/`: the step when splash's backward still computed dq inside the fused dk/dv kernel\n"
            f"  (one dq partial per key block: {pk('before_fix/~8192_auto_fused_bwd')} GiB at 8k, "
            f"{_claim('before_fix/~8192_auto_fused_bwd', 'refused')}); it now runs the separate dq kernel.\n"
            f"- `remat: attention` keeps q/k/v and attention's outputs per layer: at 16k that is {more} than\n"
            f"  `block`, and `dots` is {_claim('~16384_auto_remat-dots', 'refused')} "
            f"({_ml('~16384_auto_remat-dots')['pk']:.0f} GiB); both are for shorter sequences.\n"
            "- The samplers at these lengths still hold a max-length KV cache per row (issue 42's paged engine).\n")


def render_readme_offload() -> str:
    """docs/long-sequences.md, `model.remat: offload`: Qwen3-0.6B at 16k on v5e
    (results/memory_length/qwen3-0.6b_v5e-8_16384_auto{_remat-offload,}.json)."""
    fit, block = _ml("~16384" + OFF), _ml("~16384_auto")
    where = "needs more than the chip" if block["m"] < 0 else f"needs {block['pk']:.2f} GiB"
    return (f"the setting for {fit['k']}k-token rows. Qwen3-0.6B at {fit['k']}k completion tokens, 8 rows per chip per\n"
            f"micro-batch, on v5e: {fit['pk']:.2f} GiB per chip ({fit['m']:.0%} margin) and {fit['host']:.2f} GiB of "
            f"host memory per chip, where\n`block` {where}. `model.remat: attention` keeps q/k/v and attention's "
            "output\n")


# The pod configs' XLA:CPU compiles (results/memory_qwen3_*.json) and their rows' labels.
POD = {"memory_qwen3_0.6b_v5e8.json": "Qwen3-0.6B, v5e-8", "memory_qwen3_1.7b_v5e32.json": "Qwen3-1.7B, v5e-32"}
PROGRAMS = {"sampler": "sampler", "eval_sampler": "eval sampler", "train_step": "train step"}


def _about(frac: float) -> int:
    """A margin to the nearest 5%: 0.51 -> 50."""
    return 5 * round(frac * 20)


def render_pod_margin() -> str:
    """RESULTS "Memory of the pod configs": the margin the configs keep (results/memory_qwen3_*.json)."""
    low = _about(min(load(f)["margin_frac"] for f in POD))
    return ("figures for the TPU run's shapes and shardings: XLA:TPU lays out and fuses differently, so the\n"
            f"configs keep a margin of about {low}% (2026-12-02, jax 0.10.2, 2 CPU cores; the model's shape from\n"
            "`--preset`, its weights never materialised).\n")


def render_pod_table() -> str:
    """RESULTS "Memory of the pod configs": each program's figures per chip (results/memory_qwen3_*.json)."""
    rows = []
    for path, label in POD.items():
        d = load(path)
        w, first = d["workload"], True
        for key, name in PROGRAMS.items():
            p = d["programs"][key]
            out = f"{p['output_bytes'] / GIB:.3f}" + (" (aliased)" if p["alias_bytes"] and p["output_bytes"] else "")
            peak = f"{p['peak_bytes'] / GIB:.3f}"
            if key == d["peak_program"]:
                peak = f"**{peak}** (margin {d['margin_bytes'] / GIB:.2f}, {d['margin_frac']:.0%})"
            config = (f"{label} (fsdp {d['mesh']['fsdp']}), remat {d['model']['remat']}, {w['micro_batches']} "
                      f"micro-batches of {w['micro_batch_rows_per_device']} rows, shared prompt") if first else ""
            rows.append([config, name, f"{p['argument_bytes'] / GIB:.3f}", out, f"{p['temp_bytes'] / GIB:.3f}",
                         f"{p['held_bytes'] / GIB:.3f}" if p["held_bytes"] else "0", peak])
            first = False
    return _table(["config (as shipped now)", "program", "arguments", "outputs", "temporaries", "held", "peak"], rows)


def render_pod_compiles() -> str:
    """RESULTS "Memory of the pod configs": compile times of the 0.6B config (results/memory_qwen3_0.6b_v5e8.json)."""
    d = load("memory_qwen3_0.6b_v5e8.json")
    times = ", ".join(f"{PROGRAMS[k]} {p['compile_s']:.0f} s" for k, p in d["programs"].items())
    return f"Compiles of the 0.6B on {d['devices']} devices: {times} on 2 cores.\n"



# XLA:TPU's compiles of the v5e-8 config (results/memory_tpu/) and XLA:CPU's of the same shapes.
TPU = {"memory_tpu/qwen3_0.6b_v5e8.json": "memory_qwen3_0.6b_v5e8.json",
       "memory_tpu/qwen3_0.6b_v5e8_4096.json": "memory_tpu/qwen3_0.6b_v5e8_4096_xla_cpu.json"}
TPU_1MICRO = "memory_tpu/qwen3_0.6b_v5e8_4096_1micro.json"


def render_pod_tpu_table() -> str:
    """RESULTS "XLA:TPU's own figures": the v5e-8 config per program, XLA:CPU's temporaries in brackets
    (results/memory_tpu/*.json, results/memory_qwen3_0.6b_v5e8.json)."""
    refused = load(TPU_1MICRO)["programs"]["train_step"]
    rows = []
    for i, (path, cpu_path) in enumerate(TPU.items()):
        d, cpu = load(path), load(cpu_path)
        for j, (key, name) in enumerate(PROGRAMS.items()):
            p = d["programs"][key]
            peak, say = f"{p['peak_bytes'] / GIB:.3f}", ""
            if key == d["peak_program"]:
                peak = f"**{peak}**"
                m = d["margin_frac"]
                say = (f"fits, margin {d['margin_bytes'] / GIB:.2f} ({m:.0%})" if m >= 0
                       else f"does not fit, margin {d['margin_bytes'] / GIB:.2f}")
            label = f"{d['workload']['completion_len']:,} tokens" + (" (as shipped)" if i == 0 else "") if j == 0 else ""
            rows.append([label, name, f"{p['argument_bytes'] / GIB:.3f}",
                         f"{p['temp_bytes'] / GIB:.3f} ({cpu['programs'][key]['temp_bytes'] / GIB:.3f})",
                         f"{p['held_bytes'] / GIB:.3f}" if p["held_bytes"] else "0", peak, say])
    one = load(TPU_1MICRO)
    rows.append([f"{one['workload']['completion_len']:,} tokens, {one['workload']['micro_batches']} micro-batch",
                 "train step", "", f"refused: needs {refused['required_bytes'] / GIB:.2f}", "", "",
                 "fits" if refused["compiled"] else "does not fit"])
    return (f"GiB per chip (v5e: {load(TPU_1MICRO)['hbm_bytes'] / GIB:.0f} GiB, of which XLA:TPU counts "
            f"{refused['hbm_available_bytes'] / GIB:.2f} available); temporaries, XLA:CPU's in\nbrackets (768 tokens: "
            "the table above):\n\n"
            + _table(["Qwen3-0.6B, v5e-8 (fsdp 8)", "program", "arguments", "temporaries", "held", "peak", "verdict"],
                     rows))


def render_pod_tpu_notes() -> str:
    """RESULTS "XLA:TPU's own figures": XLA:TPU against XLA:CPU, the refusal, the update's FLOPs and the
    compile times (results/memory_tpu/*.json, results/memory_qwen3_0.6b_v5e8.json)."""
    pairs = [(load(t)["programs"], load(c)["programs"]) for t, c in TPU.items()]
    diff = [abs(tp[k]["temp_bytes"] / cp[k]["temp_bytes"] - 1) for tp, cp in pairs for k in PROGRAMS]
    long, one = load("memory_tpu/qwen3_0.6b_v5e8_4096.json"), load(TPU_1MICRO)
    update, hbm = long["programs"]["train_step"]["peak_bytes"] / GIB, long["hbm_bytes"] / GIB
    refused = one["programs"]["train_step"]
    error = refused["error"]
    quote = error[:error.index(":") + 1] + "\n... " + error[error.index("the total memory"):].rstrip(".")
    compiles = [p["compile_s"] for path in (*TPU, TPU_1MICRO) for p in load(path)["programs"].values()
                if p.get("compiled", True)]
    flops = load("memory_tpu/qwen3_0.6b_v5e8.json")["programs"]["train_step"]["flops"]
    return (f"XLA:TPU and XLA:CPU disagree by {min(diff) * 100:.0f}-{max(diff):.0%} in both directions: TPU needs more "
            "for the samplers (the KV\ncache, 28 layers x 8 KV heads x 128 x 2 x 2 bytes = 112 KiB per token, is 3.5 "
            "GiB of 32 rows x\n1,024 tokens per chip and 14.9 GiB at 4,352) and less for the update. At 4,096 tokens "
            "the samplers\nare what does not fit; the update with 2 micro-batches needs "
            f"{update:.1f} GiB, {update - hbm:.0f} GiB over, and XLA:TPU\ncompiled it anyway (it refuses only some "
            "programs above its HBM: the verdict sets every peak\nagainst the chip either way). With 1 micro-batch "
            f"XLA:TPU refuses the update (\"{quote}\"), which\n"
            "the report gives as `\"compiled\": false, \"required_bytes\", \"hbm_available_bytes\"` and the verdict\n"
            f"\"{one['verdict_line'].split(' (XLA:TPU refused')[0]}\"; the other programs\n"
            "are still measured. XLA:TPU's \"HLO temporaries\" in that message are the program's whole buffer\n"
            "assignment (a 20 GiB argument doubled into a new array reads \"(40.00G)\"). The issue's 42.6 GiB was\n"
            "not reproduced on this code at 4,096 tokens. `flops` and `bytes_accessed` count a loop's body once\n"
            f"(the layer scan, the micro-batch scan, the chunked log-probs, the decode loop): the update's {flops / 1e12:.2f}\n"
            "TFLOP per chip is a small part of the step's (6 x 0.6 B parameters x 32,768 tokens per chip = 118\n"
            f"TFLOP before the recompute). Compiles on 2 shared cores: {min(compiles):.0f}-{max(compiles):.0f} s per "
            "program for XLA:TPU.\n")


def render_readme_pod_margin() -> str:
    """docs/pods.md: what the two pod configs keep free (results/memory_qwen3_*.json)."""
    low = _about(min(load(f)["margin_frac"] for f in POD))
    share = "about half" if low == 50 else f"about {low}%"
    return ("XLA:CPU's figures for the TPU run, so keep a margin (the two `configs/qwen3_*_v5e*.yaml` keep\n"
            f"{share} of a v5e's 16 GiB: benchmarks/RESULTS.md, \"Memory of the pod configs\"). `--topology\n")


BLOCKS = {
    "lengths-attention": render_attention,
    "lengths-packing-table": render_packing_table,
    "lengths-packing-targets": render_packing_targets,
    "lengths-memory-fit": render_memory_fit,
    "lengths-memory-per-length": render_memory_per_length,
    "lengths-memory-notes": render_memory_notes,
    "lengths-readme-offload": render_readme_offload,
    "pod-margin": render_pod_margin,
    "pod-table": render_pod_table,
    "pod-compiles": render_pod_compiles,
    "pod-tpu-table": render_pod_tpu_table,
    "pod-tpu-notes": render_pod_tpu_notes,
    "pod-readme-margin": render_readme_pod_margin,
}
