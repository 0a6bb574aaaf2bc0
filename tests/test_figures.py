"""The README's (and RESULTS.md's) figure blocks are what benchmarks/figures.py writes from the committed
result files: a figure edited by hand, or a result file replaced without rerunning the script, fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_figure_block_is_what_its_result_files_give(capsys):
    figures = _figures()
    assert figures.main(["--check"]) == 0, capsys.readouterr().err
    readme = (ROOT / "README.md").read_text()
    assert {m.group("name") for m in figures.BLOCK.finditer(readme)} >= {"toc", "quickstart", "ci", "lora-demo",
                                                                         "tools", "paged"}
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert {m.group("name") for m in figures.BLOCK.finditer(results)} >= {"engine-paged"}


def test_a_figure_edited_by_hand_is_found():
    figures = _figures()
    text = (ROOT / "README.md").read_text()
    edited = text.replace("after the warm start -> ", "after the warm start -> 9", 1)
    assert edited != text
    assert figures.rewrite(edited, "README.md")[1] == ["quickstart"]
    assert figures.rewrite(text, "README.md")[1] == []


def test_the_readme_names_no_file_the_repository_lacks():
    import re

    readme = (ROOT / "README.md").read_text()
    assert "DESIGN.md" not in readme
    for path in set(re.findall(r"`((?:benchmarks|configs|grpo_jax|tests|tpu_scripts|docs)/[\w./-]+)`", readme)):
        if not any(c in path for c in "*{<") and "/your_" not in path:  # configs/your_run.yaml: an example
            assert (ROOT / path).exists() or (ROOT / path.rstrip("/")).exists(), path


def test_no_measured_figure_is_written_by_hand_outside_a_block():
    """A ratio (1.72x), an accuracy (0.742), GiB, tokens/s, a time (3 min 5 s, 12 ms) outside every figure
    block, code fence and code span is a figure no file backs: it goes into a block. Chip capacities
    (a v5e's 16 GiB) are facts, not measurements."""
    import re

    figure = re.compile(r"\b\d+\.\d{2}x\b|\b0\.\d{3}\b|\b\d+(?:\.\d+)? ?GiB\b|\b[\d,.]+k? tok/s|\b\d+ min \d+ s\b"
                        r"|\b\d+(?:\.\d+)? ms\b")
    capacity = re.compile(r"\b(?:chips of|v5e's) \d+ GiB\b")
    figures = _figures()
    found = []
    for doc in figures.DOCS:
        text = figures.BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), doc.read_text())
        text = re.sub(r"^ *```.*?^ *```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for n, line in enumerate(re.sub(r"`[^`\n]*`", "``", text).splitlines(), 1):
            if figure.search(capacity.sub("", line)):
                found.append(f"{doc.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
