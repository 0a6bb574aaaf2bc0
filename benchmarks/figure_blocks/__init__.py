"""Render functions for benchmarks/figures.py, one module per part of the docs.

Each module here defines `BLOCKS: dict[str, Callable[[], str]]` (block name -> the text between
that block's markers); `all_blocks()` gathers them. Shared readers of result files are below.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def load(path: str | Path) -> dict | list:
    """A result file's JSON (a path relative to benchmarks/results/, or absolute)."""
    return json.loads((RESULTS / path).read_text())


def metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl."""
    return [json.loads(line) for line in (RESULTS / path).read_text().splitlines() if line.strip()]


def evals(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl that hold a held-out evaluation."""
    return [r for r in metrics(path) if "eval/accuracy" in r]


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def table(head: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A Markdown table; `align` is the separator row's cells joined by '|' (default: '---' each)."""
    sep = align or "|".join(["---"] * len(head))
    return "\n".join(["| " + " | ".join(head) + " |", f"|{sep}|"] + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def all_blocks() -> dict[str, Callable[[], str]]:
    """Every module's BLOCKS, merged; a name defined twice is an error."""
    out: dict[str, Callable[[], str]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, fn in getattr(module, "BLOCKS", {}).items():
            if name in out:
                raise SystemExit(f"figure block {name!r} is defined twice (benchmarks/figure_blocks/{info.name}.py)")
            out[name] = fn
    return out
