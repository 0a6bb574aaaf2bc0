"""`grpo-jax plot RUN_DIR`: a run's headline metrics against step, in one PNG."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from grpo_jax.observe.writers import METRICS_FILE, read_metrics, series

# (title, [(metric, label)]): each panel plots whichever of its series have finite values.
_PANELS = (
    ("reward", [("reward/mean", "reward/mean")]),
    ("eval accuracy", [("eval/accuracy", "accuracy"), ("eval/pass@k", "pass@k")]),
    ("KL to reference", [("kl/k3", "k3"), ("kl/k1", "k1")]),
    ("policy entropy", [("policy/entropy", "entropy")]),
    ("completion length (tokens)", [("completion/len_mean", "mean"), ("completion/len_max", "max")]),
    ("throughput (tokens/s)", [("perf/sample_tokens_per_s", "sampling"), ("perf/train_tokens_per_s", "training")]),
)
_FIGSIZE_IN, _DPI = (15, 8), 100  # a 1500 x 800 pixel PNG


def plot_run(run_dir: str | os.PathLike, out_path: str | os.PathLike | None = None) -> Path:
    """Plot reward, eval accuracy (and pass@k), KL, entropy, completion length and throughput
    against step into a 1500x800 PNG (default `run_dir/metrics.png`); returns its path. Panels
    whose metrics were never logged say "no data"."""
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{Path(run_dir) / METRICS_FILE} has no records yet: nothing to plot")
    out = Path(run_dir) / "metrics.png" if out_path is None else Path(out_path)
    # The object API with no pyplot: no global backend or figure state, Agg renders the PNG.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=_FIGSIZE_IN, dpi=_DPI, layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    for ax, (title, panel) in zip(axes, _PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        drawn = 0
        for key, label in panel:
            steps, values = series(records, key)
            if not len(steps):
                continue
            ax.plot(steps, values, label=label, marker="o" if len(steps) <= 30 else None, markersize=3)
            if key == "reward/mean":
                std_by_step = dict(zip(*series(records, "reward/std")))
                std = np.asarray([std_by_step.get(s, np.nan) for s in steps])
                if np.isfinite(std).any():
                    ax.fill_between(steps, values - std, values + std, alpha=0.2, label="± std")
            drawn += 1
        if drawn:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.set(xticks=[], yticks=[])
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(Path(run_dir).resolve().name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)  # a viewer polling the file never reads half a PNG
    return out
