"""The figures of README.md, docs/ and benchmarks/RESULTS.md, written from committed result files.

A figure block is marked in the Markdown, and everything between its markers is this script's:

    <!-- figures:quickstart -->
    ...text written by render_quickstart() from benchmarks/results/demo_cpu/...
    <!-- /figures:quickstart -->

`python benchmarks/figures.py` rewrites every block from its files; `--check` rewrites nothing and
exits 1 naming each block whose text differs from what its files give (tests/test_figures.py runs
it, so a figure edited by hand, or a result file replaced without rerunning this, fails CI). To add
a figure: commit its result file, add a render function to BLOCKS, put the markers where it goes,
run the script. Render functions for more parts live in benchmarks/figure_blocks/ (one module
per part, each with its own BLOCKS).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from figure_blocks import all_blocks, evals, minutes  # noqa: E402  (benchmarks/figure_blocks: the other render functions)

RESULTS = ROOT / "benchmarks" / "results"
# Every page whose figures are checked: the blocks in them are rewritten, and tests/test_figures.py finds a
# measured figure written by hand outside a block in any of them. docs/paged_engine_design.md is a design memo
# (its figures are the plan's estimates), not a page of measurements, so it is not one of them.
PAGES = ("training", "data", "environments", "models", "sampling", "long-sequences", "pods", "benchmarks",
         "testing", "internals")
DOCS = (ROOT / "README.md", *(ROOT / "docs" / f"{page}.md" for page in PAGES), ROOT / "CHANGELOG.md",
        ROOT / "benchmarks" / "RESULTS.md", ROOT / "benchmarks" / "stability.md",
        ROOT / "configs" / "qwen3_30b_a3b_gsm8k_v5p16.yaml", ROOT / "configs" / "qwen3_30b_a3b_gsm8k_v5e64.yaml")
# A block's markers may be indented (inside a list item), or in a YAML comment ("# "): its lines get
# the same indent.
BLOCK = re.compile(r"^(?P<indent>(?:# )? *)(?P<open><!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                   r"(?P<close>^(?P=indent)<!-- /figures:(?P=name) -->)", re.S | re.M)


def render_quickstart() -> str:
    d = RESULTS / "demo_cpu"
    run = json.loads((d / "run.json").read_text())
    config = yaml.safe_load((d / "config.yaml").read_text())
    first, last = evals(d / "metrics.jsonl")[0], evals(d / "metrics.jsonl")[-1]
    k, prompts = config["eval"]["k"], config["eval"]["num_prompts"]
    return (f"Measured from a fresh clone on this project's 2-core machine ({run['date']}): {minutes(run['total_s'])} "
            f"in all ({minutes(run['install_s'])} for the install, {minutes(run['run_s'])} for the run).\n"
            f"Held-out accuracy ({prompts} test prompts x {k} samples at temperature {config['sampling']['temperature']:g}): "
            f"{first['eval/accuracy']:.3f} after the warm start -> {last['eval/accuracy']:.3f} after {last['step']} GRPO "
            f"steps, pass@{k} {first['eval/pass@k']:.3f} -> {last['eval/pass@k']:.3f} (run: "
            f"`benchmarks/results/demo_cpu/`).\n")


def render_ci() -> str:
    # the newest record with a CI run (a day's file may hold measurements only, until its first run)
    path = max(p for p in (RESULTS / "ci").glob("*.json") if json.loads(p.read_text()).get("runs"))
    data = json.loads(path.read_text())
    run = data["runs"][0]
    tests = re.match(r"(\d+) passed", run["pytest_line"]).group(1)
    after = (f", {minutes(run['plain_install_s'])} after them for the plain install's config checks" if run["plain_install_s"]
             else "; `.ci/plain_install`'s install and config checks ran beside them")
    return (f"measured {data['date']} from a fresh clone: {minutes(run['wall_s'])} in all: {minutes(run['tests_s'])} "
            f"for the install and the {tests} tests{after}; "
            f"the runs' figures and slowest tests:\n`{path.relative_to(ROOT)}`).\n")


def render_lora_demo() -> str:
    full, lora = evals(RESULTS / "demo_cpu" / "metrics.jsonl"), evals(RESULTS / "lora_demo" / "metrics.jsonl")
    smol = {n: evals(RESULTS / "real_models" / n / "metrics.jsonl") for n in ("smollm2", "smollm2_lora")}
    return (f"`configs/demo_cpu_lora.yaml` is the demo with rank-16 adapters (held-out accuracy "
            f"{lora[0]['eval/accuracy']:.3f} -> {lora[-1]['eval/accuracy']:.3f} in {lora[-1]['step']} steps; the full "
            f"demo {full[0]['eval/accuracy']:.3f} -> {full[-1]['eval/accuracy']:.3f}: `benchmarks/results/lora_demo/`, "
            "`benchmarks/results/demo_cpu/`). `configs/smollm2_135m_gsm8k_cpu_lora.yaml` trains\n"
            f"SmolLM2-135M-Instruct's adapters over its GGUF base: {smol['smollm2_lora'][0]['eval/accuracy']:.3f} -> "
            f"{smol['smollm2_lora'][-1]['eval/accuracy']:.3f} held-out accuracy in {smol['smollm2_lora'][-1]['step']} "
            f"steps (the full fine-tune {smol['smollm2'][-1]['eval/accuracy']:.3f}; "
            "`benchmarks/results/real_models/smollm2{,_lora}/`).\n")


def render_tools() -> str:
    """The tool demos: held-out accuracy before and after GRPO, with and without the tool."""
    def acc(name: str) -> str:
        e = evals(RESULTS / "tools" / name / "metrics.jsonl")
        return f"{e[0]['eval/accuracy']:.3f} -> **{e[-1]['eval/accuracy']:.3f}**"

    steps = {n: evals(RESULTS / "tools" / n / "metrics.jsonl")[-1]["step"] for n in ("tools", "smol_tools")}
    return ("| demo | with the tool | without (same warm start rows and steps, same GRPO steps) |\n|---|---|---|\n"
            f"| `configs/demo_cpu_tools.yaml`: the tiny char model, 4-digit sums and products, {steps['tools']} steps "
            f"| {acc('tools')} | {acc('no_tools')} |\n"
            f"| `configs/smollm2_135m_tools_cpu.yaml`: SmolLM2-135M-Instruct, word problems, {steps['smol_tools']} steps "
            f"| {acc('smol_tools')} | {acc('smol_no_tools')} |\n\n"
            "(runs: `benchmarks/results/tools/{tools,no_tools,smol_tools,smol_no_tools}/`)\n")


def render_paged() -> str:
    """The paged engine's headline figures (docs/sampling.md)."""
    d = RESULTS / "engine_paged"
    static = json.loads((d / "memory" / "sampler_16k_static.json").read_text())["programs"]["sampler"]
    paged = json.loads((d / "memory" / "sampler_16k_paged.json").read_text())
    tail, fixed = (json.loads((d / f).read_text()) for f in ("long_tail.json", "peers.json"))
    held = tail["engines"]["paged"]["concurrent_sequences"] / tail["engines"]["continuous"]["concurrent_sequences"]
    lt, fx, gib = tail["ratios"], fixed["ratios"], 2**30
    return (f"once (long completions on a chip): Qwen3-0.6B's 16k-token sampler on a v5e-8 needs "
            f"{static['required_bytes'] / gib:.2f} GiB of\ncache per chip with the static engine and compiles in "
            f"{paged['peak_bytes'] / gib:.2f} GiB with an 8 GiB pool. On this CPU,\n"
            f"where a decode step costs in proportion to its slots, it held {held:.1f}x the sequences at once at the\n"
            f"continuous engine's bytes but ran {lt['paged_vs_continuous']:.2f}x its speed on a long tail "
            f"({lt['paged_vs_static_batched']:.2f}x the static engine in\nbatches), and matched static on fixed lengths "
            "(\"Paged engine\" in `benchmarks/RESULTS.md`; `benchmarks/results/engine_paged/`).\n"
            "Multi-turn episodes ([environments.md](environments.md)) and one-pass over-sampling run on it too. It is the default because it\n"
            f"is at least as fast as `static` on both the fixed-length and the long-tailed workloads "
            f"({fx['paged_vs_static_batched']:.2f}x and\n{lt['paged_vs_static_batched']:.2f}x the static engine in "
            f"batches, {fx['paged_vs_static_all']:.2f}x and {lt['paged_vs_static_all']:.2f}x with every row at once).\n")


def _engine_label(key: str, e: dict, w: dict) -> str:
    rows, slots = w["rows"], w.get("slots") or w["rows"]
    paging, settings = e.get("paging") or {}, e.get("settings") or {}
    lockstep = ": lock-step" if (paging.get("slots") or slots) >= rows else ""
    return {"static_batched": f"static batched ({rows // slots} x {slots} rows)" if slots < rows else "static batched (= all)",
            "static_all": f"static all ({rows} rows)",
            "continuous": f"continuous ({slots} slots{lockstep})",
            "paged": f"paged ({paging.get('slots')} slots{lockstep or ', pages of ' + str(paging.get('page_size'))})",
            "transformers_cb": f"transformers `generate_batch` ({settings.get('max_requests_per_batch')} requests, "
                               f"{settings.get('num_blocks')} pages of {settings.get('page_size')})",
            "transformers_generate": f"transformers `generate` ({rows} rows)"}.get(key, key)


def _engine_rows(path: Path, workload: str | None, *, rate: str = ",.0f", prefill: bool = False) -> list[str]:
    """One table row per engine of a `grpo-jax bench engine` result (its own sizing of transformers' left out)."""
    data = json.loads(path.read_text())
    w, engines = data["workload"], {k: v for k, v in data["engines"].items() if k != "transformers_cb_auto"}
    best = max(e["useful_tokens_per_s"] for k, e in engines.items() if not k.startswith("transformers"))
    rows = []
    for i, (key, e) in enumerate(engines.items()):
        paging = e.get("paging")
        kv = e["kv_cache_bytes"]["total"] if isinstance(e["kv_cache_bytes"], dict) else e["kv_cache_bytes"]
        lockstep = paging and paging["slots"] >= w["rows"]
        pages = ("" if not paging else "none (no pages)" if lockstep
                 else f"{paging['pages_used_frac']:.0%} / {paging['pages_peak_frac']:.0%}")
        tps = format(e["useful_tokens_per_s"], rate)
        cells = [workload if i == 0 else "", _engine_label(key, e, w), f"{e['wall_s']:.2f} ({e['wall_s_min']:.2f})",
                 f"**{tps}**" if e["useful_tokens_per_s"] == best else tps,
                 "" if e["slot_utilisation"] is None else f"{e['slot_utilisation']:.1%}".replace("100.0%", "100%"),
                 "" if e["draw_steps"] is None else f"{e['draw_steps']:,}",
                 "" if e["concurrent_sequences"] is None else f"{e['concurrent_sequences']:g}",
                 "" if kv is None else f"{kv / 2**20:.0f}", pages, "" if not paging else str(paging["preemptions"])]
        cells = cells[workload is None:] + ([f"{e['prefill_s']:.2f}"] if prefill else [])
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def render_engine_paged() -> str:
    """RESULTS.md's paged-engine table: the long tail and the fixed-length peers' workload."""
    d = RESULTS / "engine_paged"
    tail, fixed = (json.loads((d / f).read_text())["workload"] for f in ("long_tail.json", "peers.json"))
    head = ["| workload | engine | wall s (fastest) | useful tok/s | slot util. | draw steps | in flight (mean) | "
            "KV MiB | pages used / peak | preemptions |", "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    return "\n".join(head + _engine_rows(d / "long_tail.json", f"long tail ({tail['rows']} seqs, M "
                                                                 f"{tail['max_new_tokens']})")
                     + _engine_rows(d / "peers.json", f"fixed {fixed['max_new_tokens']} ({fixed['rows']} rows)")) + "\n"


def _lora_bench() -> dict[str, dict]:
    """The LoRA benchmark (results/lora): per kind (full, lora), the median over its three runs of each
    run's medians, and the first run's memory accounting."""
    import statistics

    out = {}
    for kind in ("full", "lora"):
        runs = [json.loads(p.read_text()) for p in sorted((RESULTS / "lora").glob(f"cpu_grpo_step_{kind}_*.json"))]
        out[kind] = {k: statistics.median(r[k] for r in runs)
                     for k in ("step_s_median", "sample_s_median", "ref_s_median", "train_s_median")}
        out[kind]["memory"] = runs[0]["memory"]
    return out


def render_lora_speed() -> str:
    from figure_blocks.models import lora_1b

    b, big = _lora_bench(), lora_1b()
    full, lora = b["full"], b["lora"]
    share = lora["memory"]["trainable_params_bytes"] / lora["memory"]["frozen_params_bytes"]
    step = lora["step_s_median"] / full["step_s_median"]
    update = lora["train_s_median"] / full["train_s_median"]
    return (f"On the benchmark workload (`benchmarks/RESULTS.md`, `benchmarks/results/lora/`) rank-16 adapters make the "
            f"update {1 - update:.0%} faster\nand the step {1 - step:.0%}; the state is {1 + 3 * share:.2f} copies of the "
            "weights' size against 4 for a full fine-tune with\na KL reference (the reference copy alone is one of them: "
            f"{full['memory']['reference_params_bytes'] / 1e6:.1f} MB there, {big['reference_bytes'] / 1e9:.1f} GB for a "
            f"{big['params'] / 1e9:.2f}B model).\n")


def render_lora_table() -> str:
    b = _lora_bench()
    full, lora = b["full"], b["lora"]
    fm, lm = full["memory"], lora["memory"]
    rows = [("step s (median of the 3 runs' medians)", "step_s_median"), ("sampling s", "sample_s_median"),
            ("reference log-probs s", "ref_s_median"), ("update s", "train_s_median")]
    lines = ["| | full | LoRA r16 | LoRA / full |", "|---|---|---|---|"]
    lines += [f"| {label} | {full[k]:.2f} | {lora[k]:.2f} | {lora[k] / full[k]:.2f} |" for label, k in rows]
    mb = lambda n: f"{n / 1e6:.3g} MB"  # noqa: E731
    lines += [f"| trainable parameters | {mb(fm['trainable_params_bytes'])} | {mb(lm['trainable_params_bytes'])} | "
              f"{lm['trainable_params_bytes'] / fm['trainable_params_bytes']:.3f} |",
              f"| AdamW state | {mb(fm['optimizer_state_bytes'])} | {mb(lm['optimizer_state_bytes'])} | "
              f"{lm['optimizer_state_bytes'] / fm['optimizer_state_bytes']:.3f} |",
              f"| KL reference copy | {mb(fm['reference_params_bytes'])} | 0 (the frozen base, adapters off) | 0 |",
              f"| peak RSS of the process | {fm['peak_rss_bytes'] / 1e9:.2f} GB | {lm['peak_rss_bytes'] / 1e9:.2f} GB | "
              f"{lm['peak_rss_bytes'] / fm['peak_rss_bytes']:.2f} |"]
    return "\n".join(lines) + "\n"


def render_chunked() -> str:
    """docs/long-sequences.md: the chunked attention's speed against XLA's at the longest length measured."""
    rows = json.loads((RESULTS / "attention" / "cpu.json").read_text())["rows"]
    top = max(rows, key=lambda r: r["tokens"])
    diff = max(c["max_abs_diff"] for r in rows for c in r["chunked"].values())
    return ("- `chunked`: flash-style online softmax in pure JAX with its own backward pass, O(T x block)\n"
            f"  memory, on any backend (on CPU {top['best_speedup_vs_xla']:.1f}x faster than `xla` at {top['tokens']:,} "
            f"tokens, results within {diff:.0e}:\n  `benchmarks/results/attention/cpu.json`);\n")


def render_packing() -> str:
    """docs/long-sequences.md: packed against padded, the update and the whole step, over the pairs of runs."""
    ratios = []
    for padded in sorted((RESULTS / "packing").glob("packing_false*.json")):
        packed = json.loads(padded.with_name(padded.name.replace("false", "true")).read_text())
        padded = json.loads(padded.read_text())
        ratios.append((padded["train_s_median"] / packed["train_s_median"], padded["step_s_median"] / packed["step_s_median"]))
    update, step = sorted(r[0] for r in ratios), sorted(r[1] for r in ratios)
    return ("(`benchmarks/configs/grpo_long_tail.yaml`) the update ran "
            f"{update[0]:.2f}-{update[-1]:.2f}x and the whole step\n{step[0]:.2f}-{step[-1]:.2f}x faster over "
            f"{len(ratios)} pairs of runs (the machine's noise is that wide; RESULTS.md, `benchmarks/results/packing/`).\n")


def render_pipeline() -> str:
    """docs/sampling.md "Rollouts on their own devices": the split and stale layout against shared and synchronous."""
    runs = {r["name"]: r for r in json.loads((RESULTS / "pipeline" / "peers" / "summary.json").read_text())}
    base, split, both = runs["shared_k0"], runs["split_k0"], runs["split_k1"]
    return ("Measured on 2 cores with 8 emulated devices (`benchmarks/RESULTS.md`, \"Pipelined runs\";\n"
            "`benchmarks/results/pipeline/peers/summary.json`): the peers' workload with the sampler on 4 devices and the "
            f"learner on 4, one step stale, ran {base['step_s'] / both['step_s']:.2f}x the\nsteps per second of all 8 "
            f"shared and synchronous ({base['step_s'] / split['step_s']:.2f}x from the split alone, "
            f"{split['step_s'] / both['step_s']:.2f}x more from the\noverlap), the weight copy "
            f"{both['weight_sync_s'] * 1e3:.0f} ms ({both['weight_sync_s'] / both['step_s']:.1%} of a step).\n")


def render_engine_paged_gpu() -> str:
    """RESULTS.md: the engines on a lent NVIDIA H200 (results/engine_paged/gpu)."""
    d = RESULTS / "engine_paged" / "gpu"
    lines = ["| workload (H200, jax " + json.loads((d / "long_tail_gpu.json").read_text())["jax_version"] + ") | "
             "static batched tok/s | static all tok/s | continuous tok/s | paged tok/s (in flight) | "
             "paged / continuous | paged / static batched |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("long_tail_gpu", "long tail, 4 layers, hidden 256"),
                        ("long_tail_gpu_h1024", "long tail, 8 layers, hidden 1024"),
                        ("peers_gpu", "fixed 128 (64 rows), 4 layers, hidden 256")):
        data = json.loads((d / f"{name}.json").read_text())
        e, r = data["engines"], data["ratios"]
        lines.append(f"| {label} | {e['static_batched']['useful_tokens_per_s']:,.0f} | "
                     f"{e['static_all']['useful_tokens_per_s']:,.0f} | {e['continuous']['useful_tokens_per_s']:,.0f} | "
                     f"{e['paged']['useful_tokens_per_s']:,.0f} ({e['paged']['concurrent_sequences']:g}) | "
                     f"**{r['paged_vs_continuous']:.2f}x** | {r['paged_vs_static_batched']:.2f}x |")
    return "\n".join(lines) + "\n"


def render_engine_smollm2() -> str:
    """RESULTS.md's real-run table: the engines on SmolLM2-135M-Instruct (results/engine_paged/smollm2.json)."""
    head = ["| engine | wall s (fastest) | useful tok/s | slot util. | draw steps | in flight (mean) | KV MiB | "
            "pages used / peak | preemptions | prefill s |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    return "\n".join(head + _engine_rows(RESULTS / "engine_paged" / "smollm2.json", None, rate=".1f",
                                          prefill=True)) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "engine-smollm2": render_engine_smollm2,
    "engine-paged-gpu": render_engine_paged_gpu,
    "pipeline": render_pipeline,
    "chunked": render_chunked,
    "packing": render_packing,
    "lora-speed": render_lora_speed,
    "lora-table": render_lora_table,
    "engine-paged": render_engine_paged,
    "tools": render_tools,
    "paged": render_paged,
    "quickstart": render_quickstart,
    "ci": render_ci,
    "lora-demo": render_lora_demo,
}
if clash := set(BLOCKS) & set(all_blocks()):
    raise SystemExit(f"figure blocks defined twice: {sorted(clash)}")
BLOCKS.update(all_blocks())


def rewrite(text: str, where: str) -> tuple[str, list[str]]:
    """(`text` with every block rewritten, the names of the blocks that changed)."""
    changed = []

    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"{where}: block {name!r} has no render function in benchmarks/figures.py")
        body = "".join(m.group("indent") + line if line.strip() else line
                       for line in BLOCKS[name]().splitlines(keepends=True))
        if body != m.group("body"):
            changed.append(name)
        return m.group("indent") + m.group("open") + body + m.group("close")

    return BLOCK.sub(fill, text), changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = parser.parse_args(argv)
    stale, seen = [], set()
    for doc in DOCS:
        text = doc.read_text()
        seen |= {m.group("name") for m in BLOCK.finditer(text)}
        new, changed = rewrite(text, doc.name)
        stale += [f"{doc.relative_to(ROOT)}: {name}" for name in changed]
        if changed and not args.check:
            doc.write_text(new)
    unused = sorted(set(BLOCKS) - seen)
    if unused:
        print(f"blocks with no markers in {', '.join(d.name for d in DOCS)}: {', '.join(unused)}", file=sys.stderr)
        return 1
    if stale:
        print(("differs from its files" if args.check else "rewritten") + ": " + "; ".join(stale), file=sys.stderr)
        return 1 if args.check else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
