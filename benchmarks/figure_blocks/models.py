"""Figure blocks of the real models (SmolLM2-135M-Instruct, Gemma 3 270M) and of LoRA against full
fine-tuning: RESULTS.md's "LoRA vs full fine-tuning" notes, its "Real models" section, and the docs pages'
GGUF models paragraph.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import yaml

from figure_blocks import RESULTS, evals, load, metrics, minutes, table

REAL = Path("real_models")
ENTROPY_FROM = 15  # Gemma's entropy is summarised over the steps from this one on


def _steps(run: str) -> list[dict]:
    """The training rows (one per step) of results/real_models/<run>/metrics.jsonl."""
    return [r for r in metrics(REAL / run / "metrics.jsonl") if "perf/step_s" in r]


def _config(run: str) -> dict:
    return yaml.safe_load((RESULTS / REAL / run / "config.yaml").read_text())


def _mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def _median_after_first(rows: list[dict], key: str) -> float:
    """The median of a per-step figure over every step but the first (which compiles)."""
    return statistics.median(r[key] for r in rows[1:])


def _lr(value: float) -> str:
    return f"{value:.0e}".replace("e-0", "e-")


def _lora_runs(kind: str) -> list[dict]:
    """The three runs of results/lora/cpu_grpo_step_<kind>_*.json, in order."""
    return [load(p) for p in sorted((RESULTS / "lora").glob(f"cpu_grpo_step_{kind}_*.json"))]


def _lora_update_faster() -> float:
    """How much shorter the LoRA update is than the full one (medians of the runs' medians)."""
    full, lora = (statistics.median(r["train_s_median"] for r in _lora_runs(k)) for k in ("full", "lora"))
    return 1 - lora / full


def render_lora_notes() -> str:
    """RESULTS.md "LoRA vs full fine-tuning": the outlier, the update's gain and the memory accounting
    below the table (results/lora/cpu_grpo_step_{full,lora}_{1,2,3}.json)."""
    runs = _lora_runs("lora")
    slow = max(runs, key=lambda r: r["step_s_median"])
    rest = sorted(r["step_s_median"] for r in runs if r is not slow)
    fm, lm = _lora_runs("full")[0]["memory"], runs[0]["memory"]
    share = lm["trainable_params_bytes"] / lm["frozen_params_bytes"]
    lora_state = lm["frozen_params_bytes"] + lm["trainable_params_bytes"] + lm["optimizer_state_bytes"]
    full_state = fm["trainable_params_bytes"] + fm["optimizer_state_bytes"] + fm["reference_params_bytes"]
    runtime = min(lm["peak_rss_bytes"] - lora_state, fm["peak_rss_bytes"] - full_state)
    return (f"One LoRA run had a slow outlier ({slow['step_s_median']:.2f} s per step, sampling "
            f"{slow['sample_s_median']:.2f} s); the other two agreed within {1 - rest[0] / rest[-1]:.0%}.\n"
            f"The update is {_lora_update_faster():.0%} faster because the backward pass forms no gradient the size "
            "of each weight, only\nof the adapters; the sampler folds the adapters into the weights once per "
            "`generate`, so sampling\ncosts the same. With adapters the run holds "
            f"1 + {share:.3f} x 3 = {1 + 3 * share:.2f} copies of the weights' size\n(frozen base, adapters, Adam's "
            "two moments) against 4 for a full fine-tune with a reference (params,\ntwo moments, the reference copy): "
            f"on this {fm['trainable_params_bytes'] / 4 / 1e6:.1f}M-parameter model {lora_state / 1e6:.1f} MB against "
            f"{full_state / 1e6:.1f} MB, a saving\nthe {runtime / 1e9:.1f} GB of JAX runtime and compiled programs "
            "mostly hide in the RSS.\n")


def _accuracy(run: str) -> tuple[dict, dict]:
    e = evals(REAL / run / "metrics.jsonl")
    return e[0], e[-1]


def _real_column(run: str) -> dict[str, str]:
    """One model's cells of the real-models table, from its metrics.jsonl and config.yaml."""
    rows, c = _steps(run), _config(run)
    first, last = _accuracy(run)
    k, prompts = int(last["eval/k"]), int(last["eval/prompts"])
    return {
        "batch": (f"{c['data']['prompts_per_step']} prompts x G {c['sampling']['group_size']}, "
                  f"{c['sampling']['max_new_tokens']} new tokens, T {c['sampling']['temperature']:g}, "
                  f"lr {_lr(c['train']['learning_rate'])}, {c['train']['steps']} steps"),
        "prompts": str(prompts), "k": str(k),
        "accuracy": f"**{first['eval/accuracy']:.3f} -> {last['eval/accuracy']:.3f}**",
        "pass": f"**{first['eval/pass@k']:.3f} -> {last['eval/pass@k']:.3f}** (pass@{k})",
        "reward": f"{_mean(rows[:10], 'reward/mean'):.3f} -> {_mean(rows[-10:], 'reward/mean'):.3f}",
        "step": (f"{_median_after_first(rows, 'perf/step_s'):.1f} s ({_median_after_first(rows, 'perf/sample_s'):.1f}"
                 f" / {_median_after_first(rows, 'perf/train_s'):.1f})"),
        "all": minutes(sum(r["perf/step_s"] for r in rows)),
    }


def render_real_table() -> str:
    """RESULTS.md "Real models": the table of the two runs (results/real_models/{smollm2,gemma3}/
    metrics.jsonl and config.yaml)."""
    s, g = _real_column("smollm2"), _real_column("gemma3")
    rows = [
        ["command", "`grpo-jax train --config configs/smollm2_135m_gsm8k_cpu.yaml --output runs/smollm2`",
         "`grpo-jax train --config configs/gemma3_270m_arith_cpu.yaml --output runs/gemma3`"],
        ["task", "`word_problems` one-step word problems (numbers to 40), the model's chat template",
         "`arithmetic` tiny: 1-digit + - *, a 3-example few-shot prompt, newline stops"],
        ["batch", s["batch"], g["batch"]],
        ["held-out set", f"{s['prompts']} prompts x {s['k']} samples",
         f"all {g['prompts']} held-out problems x {g['k']} samples"],
        ["**accuracy before -> after**", s["accuracy"], g["accuracy"]],
        ["**pass@k before -> after**", s["pass"], g["pass"]],
        ["train reward, first 10 -> last 10 steps", s["reward"], g["reward"]],
        ["time per step (median, the first step aside; sampling / update)", s["step"], g["step"]],
        ["all steps (sum of the step times; evaluations and load aside)", s["all"], g["all"]],
    ]
    return table(["", "SmolLM2-135M-Instruct", "Gemma 3 270M (base)"], rows).replace("|  |", "| |", 1)


def render_real_lora() -> str:
    """RESULTS.md "Real models": the SmolLM2 run with LoRA against the full fine-tune
    (results/real_models/{smollm2,smollm2_lora}/, results/lora/ for the update's gain)."""
    rows, c = _steps("smollm2_lora"), _config("smollm2_lora")
    first, last = _accuracy("smollm2_lora")
    full_first, full_last = _accuracy("smollm2")
    gain = (last["eval/accuracy"] - first["eval/accuracy"]) / (full_last["eval/accuracy"] - full_first["eval/accuracy"])
    full_step = _median_after_first(_steps("smollm2"), "perf/step_s")
    lora = c["lora"]
    return (f"**The same SmolLM2 run with LoRA** (`configs/smollm2_135m_gsm8k_cpu_lora.yaml`: rank-{lora['rank']} "
            f"adapters on\nevery projection, alpha {lora['alpha']:g}, lr {_lr(c['train']['learning_rate'])}, everything "
            "else as above; 2026-12-01, `results/real_models/smollm2_lora/`):\n"
            f"held-out accuracy **{first['eval/accuracy']:.3f} -> {last['eval/accuracy']:.3f}**, pass@{int(last['eval/k'])} "
            f"**{first['eval/pass@k']:.3f} -> {last['eval/pass@k']:.3f}**, train reward (first 10 -> last 10\nsteps) "
            f"{_mean(rows[:10], 'reward/mean'):.3f} -> {_mean(rows[-10:], 'reward/mean'):.3f}, completions "
            f"{rows[0]['completion/len_mean']:.0f} -> {rows[-1]['completion/len_mean']:.0f} tokens, entropy "
            f"{rows[0]['policy/entropy']:.2f} -> {rows[-1]['policy/entropy']:.2f}; checkpoints hold only the\nadapters "
            "and their Adam moments (the base is the GGUF file, recorded by fingerprint). Its held-out\naccuracy moved "
            f"{gain:.0%} as far as the full fine-tune's in the same {c['train']['steps']} steps. Its "
            f"{_median_after_first(rows, 'perf/step_s'):.0f} s median step is not\ncomparable to the {full_step:.1f} s "
            "above: this run shared the 2 cores with test runs and reward-model training\nfor most of its time (the "
            f"update-only comparison on an idle machine is the LoRA section's: {_lora_update_faster():.0%} faster).\n")


def render_real_samples() -> str:
    """RESULTS.md "Real models": what changed, with the runs' lengths, entropies and times
    (results/real_models/{smollm2,gemma3}/metrics.jsonl)."""
    s, g = _steps("smollm2"), _steps("gemma3")
    g_first, g_last = _accuracy("gemma3")
    late = [r["policy/entropy"] for r in g if r["step"] >= ENTROPY_FROM]
    low, _, high = statistics.quantiles(late, n=4)
    return ("- SmolLM2 began by echoing the instruction (\"The answer is N.\") or wandering; after "
            f"{s[-1]['step']} steps it\n  writes one equation and \"The answer is 42.\" more often, and its completions "
            f"grew from {_mean(s[:10], 'completion/len_mean'):.0f} to {_mean(s[-10:], 'completion/len_mean'):.0f}\n"
            "  tokens on average (it learned to show the arithmetic before the number). Entropy "
            f"{s[0]['policy/entropy']:.2f} -> {s[-1]['policy/entropy']:.2f}.\n"
            "- Gemma 3 270M, a base model, first answered \"12\" (the last few-shot example's answer) to almost\n"
            f"  every question; GRPO taught it to compute: {g_first['eval/accuracy']:.3f} -> {g_last['eval/accuracy']:.3f} "
            f"on {int(g_last['eval/prompts'])} problems it never trained on\n  (the 200 training problems cannot be "
            f"memorised into held-out gains). Entropy fell from {g[0]['policy/entropy']:.2f} to "
            f"{low:.1f}-{high:.1f}\n  within {ENTROPY_FROM} steps (the middle half of steps {ENTROPY_FROM}-{g[-1]['step']}): "
            "for a short, exact answer that is the point,\n  but a longer run should keep "
            "`grpo.beta` or `entropy_coef` in mind.\n"
            "- Gemma's 262,144-token vocabulary makes its update the expensive part "
            f"({_median_after_first(g, 'perf/train_s'):.0f} s of {_median_after_first(g, 'perf/step_s'):.0f}): every\n"
            "  completion token's log-prob needs a 640 x 262,144 product, forward and backward.\n")


def render_readme_time() -> str:
    """docs/models.md's GGUF models paragraph: how long the two configs' steps took
    (results/real_models/{smollm2,gemma3}/metrics.jsonl)."""
    s, g = _steps("smollm2"), _steps("gemma3")
    total = [sum(r["perf/step_s"] for r in rows) / 60 for rows in (s, g)]
    return ("`configs/smollm2_135m_gsm8k_cpu.yaml` and `configs/gemma3_270m_arith_cpu.yaml` train them with GRPO\n"
            f"on 2 CPU cores (their {s[-1]['step']} and {g[-1]['step']} steps took {total[0]:.0f} and {total[1]:.0f} "
            "minutes, evaluations aside; measured:\nbenchmarks/RESULTS.md, \"Real models\"), and\n")


BLOCKS: dict[str, Callable[[], str]] = {
    "models-lora-notes": render_lora_notes,
    "models-real-table": render_real_table,
    "models-real-lora": render_real_lora,
    "models-real-samples": render_real_samples,
    "models-readme-time": render_readme_time,
}


def render_readme_memory() -> str:
    """docs/models.md "Memory on CPU": the peak resident memory of a two-step run of each real-model config
    (results/real_models/peak_memory.json: /usr/bin/time -v)."""
    data = load(REAL / "peak_memory.json")
    gb = {name: run["max_rss_bytes"] / 1e9 for name, run in data["runs"].items()}
    return (f"The peak resident memory of a two-step run of each config, which holds everything a whole run does (the\n"
            f"compiles, both evaluations, a checkpoint; {data['date']}, `/usr/bin/time -v`): "
            f"{gb['gemma3_270m_arith_cpu']:.1f} GB for\n`configs/gemma3_270m_arith_cpu.yaml` (64 rows a step, one "
            f"micro-batch), {gb['smollm2_135m_gsm8k_cpu']:.1f} GB for\n`configs/smollm2_135m_gsm8k_cpu.yaml` and "
            f"{gb['smollm2_135m_gsm8k_cpu_lora']:.1f} GB for its LoRA config "
            "(`benchmarks/results/real_models/peak_memory.json`):\nall fit this project's 24 GB machine.\n")


BLOCKS["models-readme-memory"] = render_readme_memory


LLAMA_1B = "memory_length/llama3.2-1b_v5e-8_8192_auto_remat-offload.json"  # `bench memory`'s count of its parameters


def lora_1b() -> dict[str, float]:
    """The LoRA accounting (params, two Adam moments, a reference copy, fp32) carried to Llama 3.2 1B: its
    parameter count from a `grpo-jax bench memory` result, its rank-16 adapters on every projection from
    the preset's shapes (grpo_jax/tools/bench/parity.py)."""
    from grpo_jax.tools.bench.parity import PRESETS

    shape = PRESETS["llama3.2-1b"][1]
    params = load(LLAMA_1B)["model"]["parameters"]
    e, f, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_kv_heads"] * shape["head_dim"]
    q = shape["num_heads"] * shape["head_dim"]
    per_layer = 16 * ((e + q) + 2 * (e + kv) + (q + e) + 2 * (e + f) + (f + e))  # q, k, v, o, gate, up, down
    adapters = per_layer * shape["num_layers"]
    return {"params": params, "adapters": adapters, "lora_bytes": 4 * (params + 3 * adapters),
            "full_bytes": 4 * 4 * params, "reference_bytes": 4 * params}


def render_lora_1b() -> str:
    """RESULTS.md "LoRA vs full fine-tuning": the same accounting on Llama 3.2 1B."""
    a = lora_1b()
    return (f"On Llama 3.2 1B ({a['params'] / 1e9:.2f}B parameters, as `grpo-jax bench memory` counts them: "
            f"`benchmarks/results/{LLAMA_1B}`;\nrank-16 adapters on every projection are {a['adapters'] / 1e6:.1f}M, "
            f"{a['adapters'] / a['params']:.1%}) in fp32 the same accounting is {a['lora_bytes'] / 1e9:.1f} GB against "
            f"{a['full_bytes'] / 1e9:.1f} GB,\nof which the reference copy alone is {a['reference_bytes'] / 1e9:.1f} GB.\n")


BLOCKS["models-lora-1b"] = render_lora_1b
