"""`grpo-jax report RUN_DIR`: one self-contained HTML page on a run's health.

It reads the run directory's `metrics.jsonl`, `samples.jsonl` and `config.yaml` (when present),
looks for GRPO's known failure patterns and the notices below them (grpo_jax.observe.health_checks:
`diagnose`), and writes `RUN_DIR/report.html`: each flag with the numbers that raised it and the
config knobs that address it, the table of every check's threshold, the held-out evaluations,
plots (raw values faint, an exponential moving average over them; PNG embedded as data URIs, so
the page needs no server and no other file), and sample completions from the first, middle and
last logged steps.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grpo_jax.config import ConfigError, RunConfig, load_config
from grpo_jax.observe.flags import MIN_STEPS, NOTICE, Flag, train_records
from grpo_jax.observe.health_checks import THRESHOLDS, diagnose
from grpo_jax.observe.writers import SAMPLES_FILE, read_metrics, series

REPORT_FILE = "report.html"
SMOOTHING = 0.1  # the moving average's weight on each new value (plots with more than SMOOTH_MIN points)
SMOOTH_MIN = 20


# (title, [(metric, label)]) per plot.
_PLOTS = (
    ("Reward and held-out accuracy", [("reward/mean", "train reward"), ("eval/accuracy", "eval accuracy"),
                                      ("eval/verifier_accuracy", "verifier accuracy")]),
    ("Policy entropy (nats/token)", [("policy/entropy", "entropy")]),
    ("Distinct answers per group", [("health/distinct_answers", "distinct answers")]),
    ("Dead groups", [("groups/frac_zero_std", "observed"), ("health/frac_zero_std_expected", "expected from pass rate"),
                     ("groups/frac_all_correct", "all correct"), ("groups/frac_all_wrong", "all wrong")]),
    ("Completion length (tokens)", [("completion/len_mean", "mean"), ("completion/len_correct", "correct"),
                                    ("completion/len_incorrect", "incorrect")]),
    ("Held-out: the training judge and the gold judge (mean score)",
     [("eval/reward_mean", "training judge (proxy)"), ("eval/verifier_reward_mean", "gold judge (eval.verifier)")]),
    ("KL to reference", [("kl/k3", "k3")]),
    ("Retention: KL(pi_0 || pi) on general text (nats/token)", [("retention/kl", "KL from the first policy")]),
    ("Retention: NLL on general text (nats/token)", [("retention/general_nll", "general NLL")]),
    ("Gradient noise scale (rows)", [("health/grad_noise_scale", "B_simple")]),
    ("Sampler vs trainer log-probs", [("health/sampler_train_logprob_diff", "mean |diff|"),
                                      ("health/sampler_train_logprob_diff_max", "max |diff|")]),
    ("Critic (PPO)", [("value/explained_variance", "explained variance"), ("value/loss", "value loss")]),
    ("Episodes: turns and tool calls", [("env/turns_mean", "model turns"), ("env/tool_calls_mean", "tool calls"),
                                        ("env/failed", "failed episodes")]),
    ("Episode tokens", [("completion/model_tokens_mean", "model"), ("completion/env_tokens_mean", "environment")]),
    ("Loss", [("train/loss", "policy loss")]),
    ("Gradient norm (before clipping)", [("train/grad_norm", "grad norm")]),
    ("Throughput (tokens/s)", [("perf/sample_tokens_per_s", "sampling"), ("perf/train_tokens_per_s", "training")]),
    ("Seconds per step", [("perf/step_s", "step"), ("perf/sample_s", "sampling")]),
    ("Learning rate", [("train/learning_rate", "learning rate")]),
)


def ema(values: np.ndarray, weight: float = SMOOTHING) -> np.ndarray:
    """Exponential moving average (NaNs carried over, not averaged in)."""
    out, acc = np.empty_like(values, dtype=np.float64), math.nan
    for i, v in enumerate(values):
        if math.isfinite(v):
            acc = v if not math.isfinite(acc) else (1 - weight) * acc + weight * v
        out[i] = acc
    return out


def _plot_png(records, title: str, panel) -> str | None:
    """One plot as a base64 PNG, or None when none of its metrics were logged."""
    from matplotlib.figure import Figure

    drawn = [(label, *series(records, key)) for key, label in panel]
    drawn = [d for d in drawn if d[1].size]
    if not drawn:
        return None
    fig = Figure(figsize=(6, 3.4), dpi=90, layout="constrained")
    ax = fig.subplots()
    for label, steps, vals in drawn:
        if len(steps) > SMOOTH_MIN:  # raw values faint, their moving average over them
            line, = ax.plot(steps, vals, alpha=0.25, linewidth=0.8)
            ax.plot(steps, ema(vals), label=f"{label} (EMA {SMOOTHING:g})", color=line.get_color())
        else:
            ax.plot(steps, vals, label=label, marker="o", markersize=3)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _load_config(run_dir: Path) -> tuple[RunConfig | None, str]:
    """(the run's config or None, a one-line summary of it or why there is none)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None, "no config.yaml in the run directory"
    try:
        config = load_config(path)
    except ConfigError as e:  # a hand-edited or older file: the report still shows the metrics
        return None, f"config.yaml does not load ({e})"
    g, t = config.grpo, config.train
    parts = [f"algorithm {config.algorithm}", f"reward_control {config.reward_control}",
             f"model {(config.model.path if config.model else None) or 'random init'}",
             f"G {config.sampling.group_size}",
             f"lr {t.learning_rate}", f"beta {g.beta}",
             f"epsilon {g.epsilon_low}/{g.epsilon_high}", f"loss_agg {g.loss_agg}",
             f"advantages {g.advantage_estimator}/{g.advantage_scale}"]
    return config, ", ".join(parts)


def _with_learning_rate(records, config: RunConfig | None) -> list[dict]:
    """`records` with `train/learning_rate` (the optimizer's schedule at each step) where the config is known."""
    if config is None:
        return list(records)
    from grpo_jax.learner.optimizer import learning_rate_at

    return [{**r, "train/learning_rate": learning_rate_at(config.train.optimizer, r["step"])} if "reward/mean" in r
            else r for r in records]


def read_samples(run_dir: Path) -> list[dict]:
    path = run_dir / SAMPLES_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a torn last line of a killed run
            continue
    return rows


def _samples_table(samples: Sequence[Mapping[str, Any]], per_step: int = 4, chars: int = 160) -> str:
    """Sample completions of the first, middle and last logged steps."""
    steps = sorted({r["step"] for r in samples if isinstance(r.get("step"), int)})
    if not steps:
        return ""
    e = html.escape
    chosen = sorted({steps[0], steps[len(steps) // 2], steps[-1]})
    rows = ["<h2 id='samples'>Samples: first, middle and last logged steps</h2><table class='samples'>"
            "<tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th></tr>"]
    for step in chosen:
        for r in [r for r in samples if r.get("step") == step][:per_step]:
            cut = (lambda text: e(str(text)[-chars:]) if len(str(text)) > chars else e(str(text)))
            reward = r.get("reward")
            rows.append(f"<tr><td>{step}</td><td><pre>{cut(r.get('prompt', ''))}</pre></td><td><pre>"
                        f"{e(str(r.get('completion', ''))[:chars])}</pre></td><td>"
                        f"{reward if not isinstance(reward, float) else f'{reward:.3f}'}</td></tr>")
    return "\n".join(rows) + "</table>"


_STYLE = """body{font-family:system-ui,sans-serif;max-width:1250px;margin:24px auto;padding:0 16px;color:#222}
h1{font-size:1.5em}.flag{border-left:6px solid #c0392b;background:#fdf2f1;padding:8px 14px;margin:12px 0}
.notice{border-left:6px solid #e6a700;background:#fff9e6;padding:8px 14px;margin:12px 0}
.samples td{text-align:left;vertical-align:top}.samples pre{white-space:pre-wrap;margin:0;max-width:520px}
.ok{border-left:6px solid #27ae60;background:#eefaf2;padding:8px 14px}.flag h3{margin:4px 0}
.plots{display:flex;flex-wrap:wrap;gap:8px}.plots img{width:600px;border:1px solid #ddd}
table{border-collapse:collapse}td,th{padding:2px 10px;border-bottom:1px solid #eee;text-align:right}
code{background:#f4f4f4;padding:0 3px}"""


def _flag_html(f: Flag) -> str:
    e = html.escape
    knobs = "".join(f"<li><code>{e(key)}</code>: {e(why)}</li>" for key, why in f.knobs)
    kind = "notice" if f.level == NOTICE else "flag"
    return (f"<div class='{kind}' data-{kind}='{e(f.key)}'><h3>{e(f.title)}</h3><p>{e(f.evidence)}</p>"
            f"<p>What addresses it:</p><ul>{knobs}</ul></div>")


def render(run_dir: Path, records: Sequence[Mapping[str, Any]], flags: Sequence[Flag], *, summary: str = "",
           samples: Sequence[Mapping[str, Any]] = ()) -> str:
    """The page's HTML."""
    e = html.escape
    train = train_records(records)
    failures, notices = [f for f in flags if f.level != NOTICE], [f for f in flags if f.level == NOTICE]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>grpo-jax report: {e(run_dir.name)}</title>"
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>Run health: {e(str(run_dir))}</h1>",
             f"<p>{len(train)} train steps logged; {e(summary)}.</p>"]
    if len(train) < MIN_STEPS:
        parts.append(f"<p class='flag'>Only {len(train)} train steps: trends need at least {MIN_STEPS}; only "
                     "skipped updates and verifier disagreement were checked.</p>")
    parts.append(f"<h2 id='flags'>Flags ({len(failures)})</h2>")
    if not failures:
        parts.append("<p class='ok' id='no-flags'>No failure pattern found.</p>")
    parts += [_flag_html(f) for f in failures]
    if notices:
        parts += [f"<h2 id='notices'>Notices ({len(notices)}): trends to watch</h2>", *map(_flag_html, notices)]
    evals = [r for r in records if "eval/accuracy" in r]
    if evals:
        judged = any("health/verifier_disagreement" in r for r in evals)
        parts.append("<h2>Held-out evaluations</h2><table><tr><th>step</th><th>accuracy</th><th>pass@k</th>"
                     + ("<th>verifier accuracy</th><th>disagreement</th>" if judged else "") + "</tr>")
        for r in evals:
            cells = [r["eval/accuracy"], r.get("eval/pass@k", math.nan)]
            if judged:
                cells += [r.get("eval/verifier_accuracy", math.nan), r.get("health/verifier_disagreement", math.nan)]
            parts.append(f"<tr><td>{r['step']}</td>" + "".join(f"<td>{v:.3f}</td>" for v in cells) + "</tr>")
        parts.append("</table>")
    parts.append("<h2>Plots</h2><div class='plots'>")
    for title, panel in _PLOTS:
        png = _plot_png(records, title, panel)
        if png is not None:
            parts.append(f"<img alt='{e(title)}' src='data:image/png;base64,{png}'>")
    parts.append("</div>")
    parts.append(_samples_table(samples))
    parts.append("<h2 id='thresholds'>What each check looks for</h2><table><tr><th>check</th><th>level</th>"
                 "<th>raised when</th></tr>" + "".join(f"<tr><td><code>{e(k)}</code></td><td>{lvl}</td><td "
                                                       f"style='text-align:left'>{e(rule)}</td></tr>"
                                                       for k, lvl, rule in THRESHOLDS) + "</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out_path: str | Path | None = None) -> tuple[Path, list[Flag]]:
    """Write the report of `run_dir` (default `run_dir/report.html`) -> (its path, the flags and
    notices: `Flag.level`)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no records yet: nothing to report")
    config, summary = _load_config(run_dir)
    eval_samples = config.eval.num_prompts * config.eval.k if config is not None else None
    flags = diagnose(records, eval_samples=eval_samples)
    out = run_dir / REPORT_FILE if out_path is None else Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    page = render(run_dir, _with_learning_rate(records, config), flags, summary=summary, samples=read_samples(run_dir))
    out.write_text(page, encoding="utf-8")
    return out, flags


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "headless_shell")


def screenshot(html_path: str | Path, png_path: str | Path, *, width: int = 1300, height: int = 2600,
               timeout: float = 120.0) -> Path:
    """Render a report in headless Chromium (the first of BROWSERS on PATH) to a PNG: proof that a
    real browser shows the page (`grpo-jax report RUN_DIR --screenshot PNG`)."""
    browser = next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        raise RuntimeError(f"no headless browser on PATH (looked for {', '.join(BROWSERS)}); install one, e.g. "
                           "apt-get install chromium")
    out = Path(png_path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--window-size={width},{height}", f"--screenshot={out}", Path(html_path).resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{browser} did not write {out} (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return out
