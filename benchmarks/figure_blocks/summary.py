"""The headline tables: README's "Results" (at most 8 rows) and the summary that opens
benchmarks/RESULTS.md (one row per measured topic, each linking to its section). Every cell is read
from the committed result files the detailed sections read; nothing here is typed by hand.
"""

from __future__ import annotations

from collections.abc import Callable

from figure_blocks import RESULTS, evals, load, metrics, table


def _acc(path: str, key: str = "eval/accuracy") -> str:
    """'0.314 -> 0.742': the first and last held-out evaluation of a metrics.jsonl."""
    rows = [r for r in metrics(path) if key in r]
    return f"{rows[0][key]:.3f} -> {rows[-1][key]:.3f}"


def _steps(path: str) -> int:
    return evals(path)[-1]["step"]


def _peers() -> tuple[float, float, float]:
    """(grpo_jax's step s, TRL's and Tunix's step time over it) on the peers' workload (results/peers/)."""
    s = {k: load(f"peers/{k}.json")["step_s_median"] for k in ("grpo_jax", "trl", "tunix")}
    return s["grpo_jax"], s["trl"] / s["grpo_jax"], s["tunix"] / s["grpo_jax"]


def _packing() -> tuple[list[float], list[float]]:
    """Padded over packed time of the update and of the whole step, per pair of runs (results/packing/)."""
    update, step = [], []
    for padded in sorted((RESULTS / "packing").glob("packing_false*.json")):
        packed = load(padded.with_name(padded.name.replace("false", "true")))
        padded = load(padded)
        update.append(padded["train_s_median"] / packed["train_s_median"])
        step.append(padded["step_s_median"] / packed["step_s_median"])
    return sorted(update), sorted(step)


def _pipeline() -> float:
    runs = {r["name"]: r for r in load("pipeline/peers/summary.json")}
    return runs["shared_k0"]["step_s"] / runs["split_k1"]["step_s"]


def _rows() -> dict[str, list[str]]:
    """Every headline row by key: [what was run, the figure, where its files are]."""
    step, trl, tunix = _peers()
    update, whole = _packing()
    paged = load("engine_paged/long_tail.json")["ratios"]
    attention = max(load("attention/cpu.json")["rows"], key=lambda r: r["tokens"])
    smol, gemma = "real_models/smollm2/metrics.jsonl", "real_models/gemma3/metrics.jsonl"
    lora = "real_models/smollm2_lora/metrics.jsonl"
    return {
        "demo": ["CPU demo (`configs/demo_cpu.yaml`): a tiny char model, 2-digit sums, "
                 f"{_steps('demo_cpu/metrics.jsonl')} GRPO steps after a warm start",
                 f"held-out accuracy {_acc('demo_cpu/metrics.jsonl')}", "`benchmarks/results/demo_cpu/`"],
        "smollm2": [f"SmolLM2-135M-Instruct, word problems, {_steps(smol)} steps on 2 CPU cores",
                    f"held-out accuracy {_acc(smol)}", "`benchmarks/results/real_models/smollm2/`"],
        "smollm2-lora": [f"SmolLM2-135M-Instruct with rank-16 LoRA, {_steps(lora)} steps",
                         f"held-out accuracy {_acc(lora)}", "`benchmarks/results/real_models/smollm2_lora/`"],
        "gemma3": [f"Gemma 3 270M (base), 1-digit arithmetic, {_steps(gemma)} steps on 2 CPU cores",
                   f"held-out accuracy {_acc(gemma)}", "`benchmarks/results/real_models/gemma3/`"],
        "tools": ["A calculator tool: the tiny model on 4-digit sums and products, "
                  f"{_steps('tools/tools/metrics.jsonl')} steps",
                  f"with the tool {_acc('tools/tools/metrics.jsonl')}, without {_acc('tools/no_tools/metrics.jsonl')}",
                  "`benchmarks/results/tools/`"],
        "reward-model": ["GRPO on a learned reward model alone (no verifier in the reward), the demo",
                         "held-out verifier accuracy "
                         + _acc("reward_model/demo_4layer/grpo_metrics.jsonl", "eval/verifier_accuracy"),
                         "`benchmarks/results/reward_model/demo_4layer/`"],
        "peers": ["One GRPO step against TRL and Tunix, the same workload on 2 CPU cores",
                  f"{step:.2f} s a step; TRL {trl:.2f}x and Tunix {tunix:.2f}x that time", "`benchmarks/results/peers/`"],
        "paged": ["Paged engine against the static one, long-tailed completion lengths (CPU)",
                  f"{paged['paged_vs_static_batched']:.2f}x the useful tokens/s", "`benchmarks/results/engine_paged/`"],
        "packing": ["Sequence packing, a long-tailed GRPO step (CPU)",
                    f"update {update[0]:.2f}-{update[-1]:.2f}x, step {whole[0]:.2f}-{whole[-1]:.2f}x faster "
                    f"({len(update)} pairs of runs)", "`benchmarks/results/packing/`"],
        "attention": [f"Chunked attention against XLA's at {attention['tokens']:,} tokens (CPU)",
                      f"{attention['best_speedup_vs_xla']:.1f}x faster", "`benchmarks/results/attention/cpu.json`"],
        "pipeline": ["Sampler on 4 devices, learner on 4, one step stale, against all 8 shared (CPU)",
                     f"{_pipeline():.2f}x the steps per second", "`benchmarks/results/pipeline/peers/`"],
    }


def render_readme_results() -> str:
    """README "Results": eight headline rows."""
    rows = _rows()
    keys = ("demo", "smollm2", "gemma3", "tools", "reward-model", "peers", "paged", "packing")
    return table(["what ran", "measured", "files"], [rows[k] for k in keys])


# RESULTS.md's summary: (row, the section of RESULTS.md that holds its details)
_SECTIONS = (("demo", "../README.md#quickstart"),
             ("smollm2", "#real-models-grpo-on-smollm2-135m-instruct-and-gemma-3-270m-2-cpu-cores"),
             ("gemma3", "#real-models-grpo-on-smollm2-135m-instruct-and-gemma-3-270m-2-cpu-cores"),
             ("smollm2-lora", "#real-models-grpo-on-smollm2-135m-instruct-and-gemma-3-270m-2-cpu-cores"),
             ("reward-model", "#reward-model-trained-on-preference-pairs"),
             ("tools", "#multi-turn-episodes-with-tools"),
             ("peers", "#whole-grpo-step-grpo_jax-vs-trl-vs-tunix"),
             ("paged", "#paged-engine"),
             ("pipeline", "#pipelined-runs-the-sampler-on-its-own-devices-bounded-staleness"),
             ("attention", "#attention-by-length-cpu"),
             ("packing", "#sequence-packing-on-a-long-tailed-grpo-step-cpu"))


def render_results_summary() -> str:
    """RESULTS.md's opening table: the headline figure of each topic, with a link to its section."""
    rows = _rows()
    body = [[rows[k][0], rows[k][1], f"[details]({anchor}); {rows[k][2]}"] for k, anchor in _SECTIONS]
    return table(["what ran", "measured", "where"], body)


BLOCKS: dict[str, Callable[[], str]] = {"readme-results": render_readme_results,
                                        "results-summary": render_results_summary}
