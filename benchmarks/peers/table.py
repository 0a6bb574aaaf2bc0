"""The peers table: OUT/<system>.json for each system -> a markdown table on stdout and OUT/table.md.

    python3 benchmarks/peers/table.py OUT [grpo_jax trl tunix]

Standard library only (run.sh calls it with any Python 3). The ratio column is each system's
median step time over grpo_jax's (above 1: grpo_jax is faster). A system whose JSON is missing
(its run failed or was skipped) gets a row of dashes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Accepted spellings of each column's key, first match wins (grpo-jax bench grpo-step writes its
# own JSON; the peer scripts write the first spelling).
KEYS = {
    "step": ("step_s_median", "step_s"),
    "sample": ("sample_s_median", "generation_s_median", "sample_s"),
    "ref": ("ref_s_median", "reference_s_median", "ref_s"),
    "train": ("train_s_median", "update_s_median", "train_s"),
    "tokens": ("tokens_per_s", "sample_tokens_per_s"),
}


def _value(rec: dict, column: str) -> float | None:
    for key in KEYS[column]:
        value = rec.get(key)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def build(out: Path, systems: list[str]) -> str:
    records = {}
    for system in systems:
        path = out / f"{system}.json"
        if path.exists():
            records[system] = json.loads(path.read_text())
    base = _value(records["grpo_jax"], "step") if "grpo_jax" in records else None
    lines = [
        ("| system | version | micro-batch rows | step s (median) | generation s | reference log-probs s | update s "
         "| tokens/s | peer step s / grpo_jax step s |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system in systems:
        rec = records.get(system)
        if rec is None:
            lines.append(f"| {system} | (no result: see {system}.log) | - | - | - | - | - | - | - |")
            continue
        step = _value(rec, "step")
        ratio = "-" if base is None or step is None else f"{step / base:.2f}"
        lines.append(
            f"| {system} | {rec.get('version', '?')} | {rec.get('workload', {}).get('micro_batch_rows', '?')} "
            f"| {_fmt(step)} | {_fmt(_value(rec, 'sample'))} "
            f"| {_fmt(_value(rec, 'ref'))} | {_fmt(_value(rec, 'train'))} | {_fmt(_value(rec, 'tokens'), 0)} "
            f"| {ratio} |"
        )
    timed = {r.get("steps_timed") for r in records.values()}
    lines.append("")
    lines.append(f"Medians over {'/'.join(str(t) for t in sorted(timed, key=str))} timed steps after the "
                 "warm-up; tokens/s = 64 x 128 generated tokens / median step s; '-' under reference "
                 "log-probs: not separable in that system (counted in update).")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    out = Path(sys.argv[1])
    systems = sys.argv[2:] or ["grpo_jax", "trl", "tunix"]
    table = build(out, systems)
    (out / "table.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
