"""The figure blocks of README.md, docs/ and benchmarks/RESULTS.md are what benchmarks/figures.py writes from the
committed result files: a figure edited by hand, or a result file replaced without rerunning the script, fails
here; so does a measured figure written by hand outside a block, and a link to a page or section that moved."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(path: Path) -> set[str]:
    return {m.group("name") for m in _figures().BLOCK.finditer(path.read_text())}


def test_every_figure_block_is_what_its_result_files_give(capsys):
    figures = _figures()
    assert figures.main(["--check"]) == 0, capsys.readouterr().err
    # README keeps the Quickstart's figures and the results table; the rest live on the docs pages by topic.
    assert _blocks(ROOT / "README.md") == {"quickstart", "ci", "readme-results"}
    docs = ROOT / "docs"
    assert _blocks(docs / "training.md") >= {"lora-demo", "lora-speed"}
    assert _blocks(docs / "environments.md") >= {"tools"}
    assert _blocks(docs / "sampling.md") >= {"paged", "pipeline"}
    assert _blocks(docs / "long-sequences.md") >= {"chunked", "packing"}
    assert _blocks(ROOT / "benchmarks" / "RESULTS.md") >= {"results-summary", "engine-paged"}
    # Every page of docs/ with figures is one figures.py checks (the design memo holds the plan's estimates).
    for page in docs.glob("*.md"):
        assert page in figures.DOCS or page.name == "paged_engine_design.md", page


def test_a_figure_edited_by_hand_is_found():
    figures = _figures()
    text = (ROOT / "README.md").read_text()
    edited = text.replace("after the warm start -> ", "after the warm start -> 9", 1)
    assert edited != text
    assert figures.rewrite(edited, "README.md")[1] == ["quickstart"]
    assert figures.rewrite(text, "README.md")[1] == []
    page = (ROOT / "docs" / "sampling.md").read_text()
    edited = page.replace("GiB of\n", "GiB of\n1", 1)
    assert edited != page
    assert figures.rewrite(edited, "sampling.md")[1] == ["paged"]


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (outside code fences)."""
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        fenced ^= line.lstrip().startswith("```")
        if not fenced and (m := re.fullmatch(r"#+ (.+)", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def test_the_docs_name_no_file_or_section_the_repository_lacks():
    """Every `path` in backticks of README.md and docs/, and every relative link of those and RESULTS.md, exists
    (a link's #anchor too): the pages moved, and a link that points at the old place fails here. (RESULTS.md and
    the paged engine's design memo name files as they were at the commits they measured or planned.)"""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md",
             ROOT / "benchmarks" / "RESULTS.md"]
    for page in pages:
        text = page.read_text()
        assert "DESIGN.md" not in text, page
        current = page.name not in ("RESULTS.md", "paged_engine_design.md")
        paths = set(re.findall(r"`((?:benchmarks|configs|grpo_jax|tests|tpu_scripts|docs)/[\w./-]+)`", text))
        for path in paths if current else ():
            if not any(c in path for c in "*{<") and "/your_" not in path:  # configs/your_run.yaml: an example
                assert (ROOT / path).exists() or (ROOT / path.rstrip("/")).exists(), (page, path)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            where = (page.parent / file).resolve() if file else page
            assert where.exists(), (page, target)
            if anchor:
                assert anchor in _anchors(where), (page, target)
    assert len(ROOT.joinpath("README.md").read_text().splitlines()) <= 250


# A measured figure: two or more decimals (0.74, 12.345: not a version such as 0.10.2), a ratio (1.4x, 2x), a
# percentage (35%), a size in GB or GiB, a rate in tokens/s, a time (3 min 5 s, 12 ms).
FIGURE = re.compile(r"(?<![\w.])\d+\.\d{2,}(?![\w.]*\d)|\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)? ?%|\b\d+(?:\.\d+)? ?Gi?B\b"
                    r"|\b[\d,.]+k? tok/s|\b\d+ min \d+ s\b|\b\d+(?:\.\d+)? ms\b")
# Not measurements: a chip's capacity (a v5e's 16 GiB), a confidence level (a 95% t interval) and a package's
# version (Python 3.11+, jax 0.10.x).
NOT_MEASURED = re.compile(r"\b(?:chips of|v5e's) \d+ GiB\b|\b95% (?:t )?interval"
                          r"|\b(?:Python|python|JAX|jax|transformers|torch|TRL|Tunix) \d+\.\d+(?:\.\w+)*\+?")


def hand_written_figures(doc: Path, text: str) -> list[str]:
    """`doc:line: text` for every measured figure outside the figure blocks, code fences and code spans
    of `text` (of a YAML file, its comments only: the rest is config values)."""
    figures = _figures()
    text = figures.BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = re.sub(r"^ *```.*?^ *```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    found = []
    for n, line in enumerate(re.sub(r"`[^`\n]*`", "``", text).splitlines(), 1):
        if doc.suffix == ".yaml" and not line.lstrip().startswith("#"):
            continue
        if FIGURE.search(NOT_MEASURED.sub("", line)):
            found.append(f"{doc.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def test_no_measured_figure_is_written_by_hand_outside_a_block():
    """A ratio (1.72x), an accuracy (0.742), a percentage, GB or GiB, tokens/s, a time (3 min 5 s, 12 ms)
    outside every figure block, code fence and code span is a figure no file backs: it goes into a block.
    Chip capacities (a v5e's 16 GiB) and package versions are facts, not measurements."""
    found = [hit for doc in _figures().DOCS for hit in hand_written_figures(doc, doc.read_text())]
    assert not found, "\n".join(found)


def test_the_guard_finds_a_figure_written_by_hand():
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert hand_written_figures(readme, text) == []
    for figure in ("0.74", "12.34", "1.4x", "2x", "35%", "4.3 GB", "16 GiB", "1,234 tok/s", "3 min 5 s", "12 ms"):
        edited = text.replace("## Results\n", f"## Results\n\nThe demo reached {figure} here.\n", 1)
        assert len(hand_written_figures(readme, edited)) == 1, figure
    for fact in ("Python 3.11+", "jax 0.10.2", "a v5e's 16 GiB", "`0.74`", "1e-4", "v5e:2x4", "0.1"):
        edited = text.replace("## Results\n", f"## Results\n\nA fact: {fact}.\n", 1)
        assert hand_written_figures(readme, edited) == [], fact
