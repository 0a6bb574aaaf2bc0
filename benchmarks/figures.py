"""The figures of README.md and benchmarks/RESULTS.md, written from committed result files.

A figure block is marked in the Markdown, and everything between its markers is this script's:

    <!-- figures:quickstart -->
    ...text written by render_quickstart() from benchmarks/results/demo_cpu/...
    <!-- /figures:quickstart -->

`python benchmarks/figures.py` rewrites every block from its files; `--check` rewrites nothing and
exits 1 naming each block whose text differs from what its files give (tests/test_figures.py runs
it, so a figure edited by hand, or a result file replaced without rerunning this, fails CI). To add
a figure: commit its result file, add a render function to BLOCKS, put the markers where it goes,
run the script.
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
RESULTS = ROOT / "benchmarks" / "results"
DOCS = (ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md")
BLOCK = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _evals(path: Path) -> list[dict]:
    return [r for r in _metrics(path) if "eval/accuracy" in r]


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def render_quickstart() -> str:
    d = RESULTS / "demo_cpu"
    run = json.loads((d / "run.json").read_text())
    config = yaml.safe_load((d / "config.yaml").read_text())
    first, last = _evals(d / "metrics.jsonl")[0], _evals(d / "metrics.jsonl")[-1]
    k, prompts = config["eval"]["k"], config["eval"]["num_prompts"]
    return (f"Measured from a fresh clone on this project's 2-core machine ({run['date']}): {_minutes(run['total_s'])} "
            f"in all ({_minutes(run['install_s'])} for the install, {_minutes(run['run_s'])} for the run).\n"
            f"Held-out accuracy ({prompts} test prompts x {k} samples at temperature {config['sampling']['temperature']:g}): "
            f"{first['eval/accuracy']:.3f} after the warm start -> {last['eval/accuracy']:.3f} after {last['step']} GRPO "
            f"steps, pass@{k} {first['eval/pass@k']:.3f} -> {last['eval/pass@k']:.3f} (run: "
            f"`benchmarks/results/demo_cpu/`).\n")


def render_ci() -> str:
    path = max((RESULTS / "ci").glob("*.json"))
    data = json.loads(path.read_text())
    run = data["runs"][0]
    tests = re.match(r"(\d+) passed", run["pytest_line"]).group(1)
    return (f"measured {data['date']} from a fresh clone: {_minutes(run['wall_s'])} in all: {_minutes(run['tests_s'])} "
            f"for the install and the {tests} tests, {_minutes(run['plain_install_s'])} for `.ci/plain_install`; "
            f"the runs' figures and slowest tests: `{path.relative_to(ROOT)}`).\n")


def render_lora_demo() -> str:
    full, lora = _evals(RESULTS / "demo_cpu" / "metrics.jsonl"), _evals(RESULTS / "lora_demo" / "metrics.jsonl")
    smol = {n: _evals(RESULTS / "real_models" / n / "metrics.jsonl") for n in ("smollm2", "smollm2_lora")}
    return (f"`configs/demo_cpu_lora.yaml` is the demo with rank-16 adapters (held-out accuracy "
            f"{lora[0]['eval/accuracy']:.3f} -> {lora[-1]['eval/accuracy']:.3f} in {lora[-1]['step']} steps; the full "
            f"demo {full[0]['eval/accuracy']:.3f} -> {full[-1]['eval/accuracy']:.3f}: `benchmarks/results/lora_demo/`, "
            "`benchmarks/results/demo_cpu/`). `configs/smollm2_135m_gsm8k_cpu_lora.yaml` trains\n"
            f"SmolLM2-135M-Instruct's adapters over its GGUF base: {smol['smollm2_lora'][0]['eval/accuracy']:.3f} -> "
            f"{smol['smollm2_lora'][-1]['eval/accuracy']:.3f} held-out accuracy in {smol['smollm2_lora'][-1]['step']} "
            f"steps (the full fine-tune {smol['smollm2'][-1]['eval/accuracy']:.3f}; "
            "`benchmarks/results/real_models/smollm2{,_lora}/`).\n")


def render_toc() -> str:
    """README's sections, each a link to its heading (GitHub's anchors)."""
    lines, fenced = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.fullmatch(r"(##+) (.+)", line)):
            anchor = re.sub(r"[^\w\- ]", "", m.group(2).lower()).replace(" ", "-")
            lines.append(f"{'  ' * (len(m.group(1)) - 2)}- [{m.group(2)}](#{anchor})")
    return "\n".join(["**Contents**", "", *lines]) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "toc": render_toc,
    "quickstart": render_quickstart,
    "ci": render_ci,
    "lora-demo": render_lora_demo,
}


def rewrite(text: str, where: str) -> tuple[str, list[str]]:
    """(`text` with every block rewritten, the names of the blocks that changed)."""
    changed = []

    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"{where}: block {name!r} has no render function in benchmarks/figures.py")
        body = BLOCKS[name]()
        if body != m.group("body"):
            changed.append(name)
        return m.group(1) + body + m.group(4)

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
