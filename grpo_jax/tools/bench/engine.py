"""`grpo-jax bench engine`: the static, continuous and paged rollout engines on a run config's model
and prompts, at the same KV-cache budget, as JSON (and a PNG next to it).

The comparison a memory-bound chip faces: with a KV budget of `sampling.slots` rows, the static
engine runs `slots / G` prompts at a time, one batch after another (`static_batched`), and the
paged engine keeps `slots` slots busy over all sequences with one max-length reservation each
(`continuous`: `sampling.engine: continuous`, the per-slot engine's settings), and runs
`paged_slots` slots over a page pool of those cache bytes (`paged`:
concurrent sequences, preemptions and page use reported); beside them, the
static engine with every row at once (`static_all`, what a run does when the cache fits). Per
engine: wall seconds (median of `iters` interleaved calls after a first call, whose compile is
reported apart), useful tokens (the rollout's lengths: completion tokens up to and including the
stop token), useful tokens/s, slot utilisation (useful slot-steps over all slot-steps: for the
static engine sum(lengths) / (rows x draw steps run, the longest row of each call); for the
continuous engine its own counts), the prompt pass's seconds (a jitted prefill-only call of the
engine's own prefill), KV-cache bytes (from the shapes of the cache it builds) and the lengths'
distribution. `--peer transformers` adds transformers' continuous batching and `generate` on the
same weights (grpo_jax.tools.bench.engine_peer), timed in the same rounds.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import grpo_jax

PEERS = ("none", "transformers")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def source_commit() -> dict | None:
    """The commit this code runs from, and whether the engines' files differ from it (other work
    in progress in the same tree changes what is measured); None outside a git checkout."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "grpo_jax/engine", "grpo_jax/rollout", "grpo_jax/models"], cwd=root,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": head.stdout.strip(), "engine_files_modified": dirty.stdout.splitlines()}


def _figures(timing: dict, prefill: dict | None, kv: dict | None, max_new_tokens: int) -> dict:
    """One engine's figures from its timed calls (engine_runs.time_interleaved)."""
    from grpo_jax.tools.bench.engine_runs import length_stats, median

    run, wall = timing["result"], median(timing["times"])
    useful = int(run.lengths.sum())
    return {
        "wall_s": round(wall, 4), "wall_s_min": round(min(timing["times"]), 4),
        "wall_s_all": [round(t, 4) for t in timing["times"]],
        "first_call_s": round(timing["first_s"], 3),
        # 0 where an engine before it compiled the same program (static_batched = static_all at slots = rows).
        "compile_s": round(max(0.0, timing["first_s"] - wall), 3),
        "useful_tokens": useful, "useful_tokens_per_s": round(useful / wall, 1),
        "slot_utilisation": None if not run.slot_steps else round(useful / run.slot_steps, 4),
        "draw_steps": run.draw_steps or None, "slot_steps": run.slot_steps,
        "engine_useful_slot_steps": run.engine_useful_slot_steps, "prefill_rows": run.prefill_rows,
        "prefill_s": None if prefill is None else round(median(prefill["times"]), 4),
        "kv_cache_bytes": kv, "lengths": length_stats(run.lengths, run.truncated, max_new_tokens),
        "sequence_lengths": run.lengths.tolist(),
        # Sequences decoding at once, on average over the loop's steps (its own counts).
        "concurrent_sequences": (round(run.engine_useful_slot_steps / run.draw_steps, 1)
                                 if run.engine_useful_slot_steps and run.draw_steps else None),
        **({"paging": run.paging} if run.paging else {}),
    }


def ratios(engines: dict, wall: str = "wall_s") -> dict:
    """Useful tokens/s of one engine over another's, from each engine's `wall` seconds (the median;
    "wall_s_min": the fastest call); against transformers' faster continuous-batching setting."""
    def tps(name):
        return engines[name]["useful_tokens"] / engines[name][wall]

    def ratio(a, b):
        return round(tps(a) / tps(b), 3) if a in engines and b in engines else None

    out = {"continuous_vs_static_batched": ratio("continuous", "static_batched"),
           "continuous_vs_static_all": ratio("continuous", "static_all"),
           "static_all_vs_static_batched": ratio("static_all", "static_batched"),
           "paged_vs_continuous": ratio("paged", "continuous"), "paged_vs_static_batched": ratio("paged", "static_batched"),
           "paged_vs_static_all": ratio("paged", "static_all")}
    if "transformers_cb" in engines:
        cb = max(("transformers_cb", "transformers_cb_auto"), key=tps)
        out.update({"continuous_vs_transformers_cb": ratio("continuous", cb), "transformers_cb_used": cb,
                    "paged_vs_transformers_cb": ratio("paged", cb),
                    "continuous_vs_transformers_generate": ratio("continuous", "transformers_generate")})
    return out


def engine(config_path: str, *, overrides: Sequence[str] = (), iters: int = 3, peer: str = "none",
           paged_slots: int = 0, output: str | None = None, log: Callable[[str], None] = _stderr) -> dict:
    """Time the engines on the config's model and first `data.prompts_per_step` prompts (module
    docstring); `peer="transformers"` adds transformers' engines; `paged_slots`: the paged engine's
    decode slots (0: 3 x sampling.slots, at most one per sequence). `output` (the CLI's --output):
    the PNG is written next to it."""
    import jax

    from grpo_jax.config import ConfigError
    from grpo_jax.tools.bench import engine_runs as er

    if iters < 1 or peer not in PEERS or paged_slots < 0:
        raise ConfigError(f"bench engine needs --iters >= 1, --peer in {PEERS} and --paged-slots >= 0, got {iters}, "
                          f"{peer!r} and {paged_slots}")
    before = source_commit()
    w = er.load_workload(config_path, overrides)
    log(f"bench engine: {w.description['prompts']} prompts x {w.sampling.group_size}, {w.slots} slots, "
        f"max_new_tokens {w.sampling.max_new_tokens}; {w.description['model']}")
    paged_slots = min(paged_slots or 3 * w.slots, w.rows)
    runners, peer_info = er.engine_runners(w, paged_slots), None
    if peer == "transformers":
        from grpo_jax.tools.bench.engine_peer import transformers_runners

        peer_runners, peer_info = transformers_runners(w, seed=w.seed)
        runners.update(peer_runners)
    timing = er.time_interleaved(runners, iters, log)
    prefill = er.time_interleaved(er.prefill_runners(w), max(iters, 3), lambda line: log(line.replace(
        "bench engine:", "bench engine prefill:")))
    kv = er.kv_cache_bytes(w)
    M = w.sampling.max_new_tokens
    engines = {name: _figures(t, prefill.get(name), kv.get(name), M) for name, t in timing.items()}
    for name, info in (peer_info or {}).items():
        if name in engines:
            engines[name]["kv_cache_bytes"] = info.pop("kv_cache_bytes")
            engines[name]["settings"] = info
    result = {"benchmark": "engine", "version": grpo_jax.__version__, "config": str(config_path),
              "overrides": list(overrides), "iters": iters, "workload": w.description, "engines": engines,
              "ratios": ratios(engines), "ratios_by_fastest_call": ratios(engines, "wall_s_min"),
              "peer": {k: v for k, v in (peer_info or {}).items() if k not in engines},
              "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "jax_version": jax.__version__, "source": before, "source_after": source_commit()}
    if output:
        from pathlib import Path

        result["plot"] = str(Path(output).with_suffix(".png"))
        Path(result["plot"]).parent.mkdir(parents=True, exist_ok=True)
        plot_engine([result], result["plot"])
    r = result["ratios"]
    log(f"bench engine: continuous / static batched {r['continuous_vs_static_batched']}, "
        f"/ static all {r['continuous_vs_static_all']}; paged ({paged_slots} slots) / continuous "
        f"{r['paged_vs_continuous']}, / static batched {r['paged_vs_static_batched']}")
    return result


def plot_engine(results: Sequence[dict], path: str) -> None:
    """Useful tokens/s (log scale, value on each bar) and slot utilisation per engine, one group of
    bars per workload (result)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(n for r in results for n in r["engines"]))
    fig, (ax_t, ax_u) = plt.subplots(2, 1, figsize=(4 + 2.6 * len(results), 7))
    width = 0.8 / len(names)
    x = np.arange(len(results))
    for i, name in enumerate(names):
        tps = [r["engines"].get(name, {}).get("useful_tokens_per_s") or 0 for r in results]
        util = [r["engines"].get(name, {}).get("slot_utilisation") or 0 for r in results]
        bars = ax_t.bar(x + i * width, tps, width, label=name.replace("_", " "), color=f"C{i}")
        ax_t.bar_label(bars, [f"{v:.0f}" if v else "" for v in tps], fontsize=6, rotation=90, padding=2)
        ax_u.bar(x + i * width, [100 * u for u in util], width, color=f"C{i}")
    labels = []
    for r in results:
        w = r["workload"]
        seed = f", seed {w['seed']}" if "seed" in w else ""
        labels.append(f"{r['config'].rsplit('/', 1)[-1].removesuffix('.yaml')}{seed}\n{w['rows']} seqs, "
                      f"{w['slots']} slots, P {w['prompt_bucket']}, M {w['max_new_tokens']}")
    for ax, ylabel in ((ax_t, "useful tokens / s (median)"), (ax_u, "slot utilisation (%)")):
        ax.set_xticks(x + width * (len(names) - 1) / 2, labels, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
    ax_t.set_yscale("log")
    ax_t.set_ylim(top=ax_t.get_ylim()[1] * 3)
    ax_t.legend(fontsize=7, ncol=3)
    fig.suptitle(f"grpo_jax rollout engines ({results[0]['device']}, jax {results[0]['jax_version']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
