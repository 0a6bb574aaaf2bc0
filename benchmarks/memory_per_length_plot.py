"""The train step's memory per chip against the completion length, today's attention (`xla`: the
[B, H, T, S] scores materialised) vs the new one (`auto`: splash on TPU, chunked on CPU), from the
`grpo-jax bench memory --programs train_step` results in benchmarks/results/memory_length/ (issue 41).

    python benchmarks/memory_per_length_plot.py [DIR] [--out PNG]

One panel per slice (columns) and workload (rows: 8 rows per chip per micro-batch, and 1 row per
chip per micro-batch), remat block; one line per model and attention: new (auto), new with
`model.remat: offload` (the saved layer inputs in host memory), today's (xla), and e1d5465's code (before the attention changes, where measured); a program XLA:TPU refused is
drawn hollow at what its refusal says it needs (a lower bound). The dotted lines are the chip's HBM
and 70% of it (a 30% margin).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GIB = 1 << 30
HERE = Path(__file__).parent / "results" / "memory_length"
WORKLOADS = (8, 1)  # rows per chip per micro-batch: the tables' two workloads
STYLES = (("offload", "-"), ("auto", "--"), ("xla", ":"), ("before", "-."), ("auto, XLA:CPU", (0, (1, 3))))
LABELS = {"offload": "new, remat offload", "auto": "new (auto)", "xla": "today (xla)", "before": "e1d5465 (before)",
          "auto, XLA:CPU": "new, XLA:CPU"}
SLICES = {"v5e:2x4": "v5e-8 (XLA:TPU)", "v5p:2x2x1": "v5p-8, 4 chips (XLA:TPU)", "v5e:4x8": "v5e-32 (XLA:TPU)"}
COLOURS = {"qwen3-0.6b": "tab:blue", "qwen3-1.7b": "tab:orange", "llama3.2-1b": "tab:green"}


def point(result: dict) -> dict:
    """One result's coordinates: slice, model, attention, remat, rows, length, train step GiB, refused."""
    sets = dict(o.split("=", 1) for o in result["overrides"])
    step = result["programs"]["train_step"]
    return {"slice": result.get("topology", f"cpu:{result['devices']}"),
            "model": result["model"]["source"].removeprefix("preset "),
            "attention": ("before" if result.get("code", "").startswith("e1d5465") else
                          "offload" if result["model"]["remat"] == "offload" else sets.get("model.attention", "auto")),
            "remat": result["model"]["remat"], "rows": result["workload"]["micro_batch_rows_per_device"],
            "length": result["workload"]["completion_len"], "gib": step["peak_bytes"] / GIB,
            "refused": not step["compiled"], "hbm": result["hbm_bytes"] / GIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", default=str(HERE))
    parser.add_argument("--out", default=None, help="the PNG (default: DIR/memory_per_length.png)")
    args = parser.parse_args()
    points = [point(json.loads(p.read_text())) for p in sorted(Path(args.dir).glob("*.json"))]
    points = [p for p in points if p["remat"] in ("block", "offload")]
    slices = [s for s in SLICES if any(p["slice"] == s for p in points)]
    fig, axes = plt.subplots(len(WORKLOADS), len(slices), figsize=(5.2 * len(slices), 4.4 * len(WORKLOADS)),
                             squeeze=False, sharey=True)
    for row, rows in zip(axes, WORKLOADS):
        for ax, where in zip(row, slices):
            _panel(ax, [p for p in points if p["rows"] == rows], where)
            ax.set_title(f"{SLICES[where]}, {rows} row{'s' if rows > 1 else ''} per chip per micro-batch", fontsize=9)
    for row in axes:
        row[0].set_ylabel("train step peak, GiB per chip")
    fig.suptitle("Train step memory per chip vs completion length (remat block unless offload; hollow: refused by "
                 "XLA:TPU, at least)",
                 fontsize=10)
    fig.tight_layout()
    out = args.out or str(Path(args.dir) / "memory_per_length.png")
    fig.savefig(out, dpi=110)
    print(out)


def _panel(ax, points: list[dict], where: str) -> None:
    here = [p for p in points if p["slice"] == where]
    if where == "v5e:2x4":  # XLA:CPU's figures of the same v5e-8 run beside XLA:TPU's
        here += [{**p, "attention": p["attention"] + ", XLA:CPU"} for p in points if p["slice"] == "cpu:8"]
    for model in COLOURS:
        for attention, style in STYLES:
            line = sorted((p for p in here if p["model"] == model and p["attention"] == attention),
                          key=lambda p: p["length"])
            if not line:
                continue
            ax.plot([p["length"] for p in line], [p["gib"] for p in line], linestyle=style, color=COLOURS[model],
                    label=f"{model}, {LABELS[attention]}")
            for p in line:
                ax.plot(p["length"], p["gib"], "o", color=COLOURS[model],
                        markerfacecolor="none" if p["refused"] else COLOURS[model])
    if not here:
        ax.set_axis_off()  # nothing measured for this slice and workload
        return
    hbm = here[0]["hbm"]
    ax.axhline(hbm, color="k", linestyle=":", linewidth=1)
    ax.axhline(0.7 * hbm, color="grey", linestyle=":", linewidth=1)
    ax.text(4096, hbm * 1.05, f"HBM {hbm:.0f} GiB", fontsize=8)
    ax.text(4096, 0.7 * hbm * 0.88, "70%", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks([4096, 8192, 16384, 32768], ["4k", "8k", "16k", "32k"])
    ax.set_xlabel("completion tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")


if __name__ == "__main__":
    main()
