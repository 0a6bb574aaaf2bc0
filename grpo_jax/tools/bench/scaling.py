"""`grpo-jax bench scaling`: step time against the work (group size, completion length, prompts
per step), one `grpo_step` per point, as JSON and a PNG of stacked step parts."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpo_jax
from grpo_jax.tools.bench.step import grpo_step

SCALING_AXES = {  # sweep name -> (config key, default values)
    "group_size": ("sampling.group_size", (2, 4, 8, 16, 32)),
    "completion_len": ("sampling.max_new_tokens", (64, 128, 256, 512)),
    "prompts_per_step": ("data.prompts_per_step", (2, 4, 8, 16)),
}
# The per-point figures kept from each grpo_step result.
_POINT_FIELDS = ("step_s_median", "sample_s_median", "reward_s_median", "ref_s_median", "train_s_median",
                 "tokens_per_s", "flops_per_step", "mfu", "train_mfu", "peak_memory_bytes")


def scaling_micro_batches(rows: int, group_size: int, micro_batch_rows: int) -> int:
    """Micro-batches for `rows` completions: as close to `micro_batch_rows` rows each as whole
    groups allow (a micro-batch holds at least one group)."""
    per = max(group_size, micro_batch_rows - micro_batch_rows % group_size)
    mb = max(1, rows // per)
    while rows % mb or (rows // mb) % group_size:
        mb -= 1
    return mb


def _checked_sweeps(sweeps: dict[str, Sequence[int]] | None) -> dict[str, tuple[int, ...]]:
    from grpo_jax.config import ConfigError

    sweeps = {k: tuple(v) for k, v in (sweeps or {k: v for k, (_, v) in SCALING_AXES.items()}).items()}
    unknown = sorted(set(sweeps) - set(SCALING_AXES))
    if unknown:
        raise ConfigError(f"bench scaling: unknown sweep {unknown}; choose from {sorted(SCALING_AXES)}")
    if any(not values or any(int(v) < 1 for v in values) for values in sweeps.values()):
        raise ConfigError(f"bench scaling: every sweep needs values >= 1, got {sweeps}")
    return sweeps


def _point_overrides(work: dict, micro_batches: int, fixed_len: bool) -> list[str]:
    sets = [f"sampling.group_size={work['group_size']}", f"sampling.max_new_tokens={work['completion_len']}",
            f"data.prompts_per_step={work['prompts_per_step']}", f"train.micro_batches={micro_batches}"]
    if fixed_len:
        sets.append(f"sampling.min_new_tokens={work['completion_len']}")
    return sets


def scaling(config_path: str, *, overrides: Sequence[str] = (), sweeps: dict[str, Sequence[int]] | None = None,
            steps: int = 2, warmup: int = 1, log: Callable[[str], None] = print) -> dict:
    """Step time against the work: `grpo_step` of the config with one of group size, completion
    length or prompts per step changed at a time (`sweeps`: axis -> values, default SCALING_AXES).

    Every point keeps the config's micro-batch size in rows (rounded to whole groups), so that the
    curves show how cost grows with the work, not a change of micro-batching. With `min_new_tokens`
    equal to `max_new_tokens` in the config, completions stay fixed-length along the length sweep.
    """
    from grpo_jax.config import load_config

    base = load_config(config_path, overrides)
    sweeps = _checked_sweeps(sweeps)
    start = {"group_size": base.sampling.group_size, "completion_len": base.sampling.max_new_tokens,
             "prompts_per_step": base.data.prompts_per_step}
    micro_rows = start["prompts_per_step"] * start["group_size"] // base.train.micro_batches
    fixed_len = base.sampling.min_new_tokens == base.sampling.max_new_tokens
    points = []
    for axis, values in sweeps.items():
        for value in values:
            work = {**start, axis: int(value)}
            mb = scaling_micro_batches(work["prompts_per_step"] * work["group_size"], work["group_size"], micro_rows)
            t = time.perf_counter()
            result = grpo_step(config_path, overrides=[*overrides, *_point_overrides(work, mb, fixed_len)],
                               steps=steps, warmup=warmup)
            point = {"axis": axis, "value": int(value), **work, "micro_batches": mb,
                     **{k: result[k] for k in _POINT_FIELDS}}
            points.append(point)
            log(f"scaling {axis}={value}: step {point['step_s_median']:.2f} s (sample {point['sample_s_median']:.2f}, "
                f"reference {point['ref_s_median']:.2f}, update {point['train_s_median']:.2f}), "
                f"{time.perf_counter() - t:.0f} s with compilation")
    return {"benchmark": "scaling", "version": grpo_jax.__version__, "config": str(config_path),
            "overrides": list(overrides), "steps_timed": steps, "warmup_steps": warmup,
            "base": {**start, "micro_batch_rows": micro_rows},
            "points": points, "device": result["device"], "backend": result["backend"]}


def plot_scaling(result: dict, path: str) -> None:
    """One panel per swept axis: the step's parts stacked against the swept value (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_swept = list(dict.fromkeys(p["axis"] for p in result["points"]))
    fig, panels = plt.subplots(1, len(axes_swept), figsize=(5 * len(axes_swept), 4), squeeze=False)
    parts = (("sample_s_median", "sampling"), ("ref_s_median", "reference log-probs"), ("train_s_median", "update"))
    for ax, axis in zip(panels[0], axes_swept):
        pts = sorted((p for p in result["points"] if p["axis"] == axis), key=lambda p: p["value"])
        x = [p["value"] for p in pts]
        bottom = [0.0] * len(pts)
        for key, label in parts:
            y = [p[key] for p in pts]
            ax.fill_between(x, bottom, [b + v for b, v in zip(bottom, y)], alpha=0.5, label=label, step=None)
            bottom = [b + v for b, v in zip(bottom, y)]
        ax.plot(x, [p["step_s_median"] for p in pts], "k.-", label="whole step")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel(axis.replace("_", " "))
        ax.set_ylabel("seconds per step (median)")
        ax.grid(alpha=0.3)
        base = result["base"]
        ax.set_title(", ".join(f"{k.replace('_', ' ')} {v}" for k, v in base.items() if k != axis
                               and k != "micro_batch_rows"), fontsize=9)
    panels[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"grpo_jax GRPO step vs work ({result['device']}, {result['config']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
