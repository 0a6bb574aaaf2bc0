"""`grpo-jax report RUN_DIR`: one self-contained HTML page on a run's health.

It reads the run directory's `metrics.jsonl` (and `config.yaml` when present), looks for GRPO's
known failure patterns (`diagnose`), and writes `RUN_DIR/report.html`: each flag with the numbers
that raised it and the config knobs that address it, then plots (PNG, embedded as data URIs, so
the page needs no server and no other file).

The checks compare an early window of steps with a late one (`_windows`: the first and last
quarter of the logged steps, at least 3 each) so a single noisy step raises nothing. Thresholds are
module constants, stated in each flag's evidence.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grpo_jax.config import ConfigError, load_config
from grpo_jax.observe.writers import read_metrics, series

REPORT_FILE = "report.html"
MIN_STEPS = 8  # fewer logged train steps than this: too short to judge trends (said on the page)

# Thresholds (late window vs early window unless said otherwise).
ENTROPY_DROP = 0.35  # late entropy below this share of the early one
DEAD_EXCESS = 0.2  # observed dead-group fraction above the pass-rate expectation by this much
DEAD_MIN = 0.3  # ... and at least this many groups dead
REWARD_RISE = 0.05  # training reward up by at least this much
ACCURACY_FALL = 0.05  # held-out accuracy below its best by at least this much (with reward rising)
HELDOUT_REGRESSION = 0.1  # ... by this much whatever the reward does
LENGTH_GROWTH = 1.5  # late completion length over early
TRUNCATED_MAX = 0.2  # share of truncated completions late in the run
KL_MAX = 0.5  # late k3 KL to the reference, in nats per token
LOGPROB_DIFF_MEAN = 0.02  # mean |sampler - trainer| log-prob per token
LOGPROB_DIFF_MAX = 1.0  # largest single-token difference
VERIFIER_DISAGREEMENT = 0.05  # held-out samples the two judges disagree on


@dataclasses.dataclass(frozen=True)
class Flag:
    key: str  # a stable identifier, e.g. "entropy_collapse"
    title: str
    evidence: str  # the numbers that raised it
    knobs: tuple[tuple[str, str], ...]  # (config key or setting, how it helps) for what addresses it


def _windows(values: np.ndarray) -> tuple[float, float] | None:
    """(mean of the first quarter, mean of the last quarter), each at least 3 values; None if too few."""
    if values.size < 2 * 3:
        return None
    w = max(3, values.size // 4)
    return float(values[:w].mean()), float(values[-w:].mean())


def _train_records(records):
    return [r for r in records if r["step"] > 0 and "reward/mean" in r]


def _entropy_collapse(train) -> Flag | None:
    _, ent = series(train, "policy/entropy")
    w = _windows(ent)
    if w is None or w[0] <= 0 or w[1] >= ENTROPY_DROP * w[0]:
        return None
    _, distinct = series(train, "health/distinct_answers")
    d = _windows(distinct)
    extra = f"; distinct answers per group {d[0]:.2f} -> {d[1]:.2f}" if d else ""
    return Flag("entropy_collapse", "Entropy collapse",
                f"policy/entropy fell from {w[0]:.3f} to {w[1]:.3f} nats/token (below {ENTROPY_DROP:.0%} of its "
                f"start){extra}. A collapsed policy samples the same completion G times: its groups stop "
                "carrying signal and exploration ends.",
                (("grpo.epsilon_high", "clip-higher, e.g. 0.28: lets low-probability tokens grow"),
                 ("grpo.entropy_coef", "an entropy bonus, e.g. 1e-3"), ("train.learning_rate", "lower"),
                 ("sampling.temperature", "sample at 1.0")))


def _dead_groups(train) -> Flag | None:
    _, observed = series(train, "groups/frac_zero_std")
    _, expected = series(train, "health/frac_zero_std_expected")
    if observed.size < 3 or expected.size != observed.size:
        return None
    half = slice(observed.size // 2, None)
    obs, exp = float(observed[half].mean()), float(expected[half].mean())
    if obs < DEAD_MIN or obs - exp < DEAD_EXCESS:
        return None
    _, right = series(train, "groups/frac_all_correct")
    _, wrong = series(train, "groups/frac_all_wrong")
    split = (f" ({right[half].mean():.0%} of groups all correct, {wrong[half].mean():.0%} all wrong)"
             if right.size == observed.size and wrong.size == observed.size else "")
    return Flag("dead_groups", "Dead groups above what the pass rate predicts",
                f"over the second half, {obs:.0%} of groups had identical rewards{split}, against {exp:.0%} "
                f"expected if every prompt had the batch's pass rate (excess {obs - exp:.0%} > {DEAD_EXCESS:.0%}). "
                "Those groups give zero advantage: the batch is effectively smaller and its gradient noisier.",
                (("train.dynamic_sampling", "DAPO: resample groups with identical rewards"),
                 ("data", "a curriculum closer to the model's level: drop solved and hopeless prompts"),
                 ("sampling.group_size", "larger groups are less often uniform"),
                 ("grpo.advantage_scale: none", "Dr. GRPO: no std scaling, so near-uniform groups are not amplified")))


def _best_checkpoint(step: int) -> tuple[str, str]:
    if step == 0:
        return ("train.steps", "the policy before any update had the best held-out accuracy")
    return (f"checkpoints/{step}", "the best held-out accuracy, if that step was saved (checkpoint.every)")


def _reward_vs_heldout(train, records) -> Flag | None:
    _, reward = series(train, "reward/mean")
    w = _windows(reward)
    steps, acc = series(records, "eval/accuracy")
    if w is None or acc.size < 3:
        return None
    best = int(np.argmax(acc))
    if w[1] - w[0] < REWARD_RISE or best == acc.size - 1 or acc[best] - acc[-1] < ACCURACY_FALL:
        return None
    return Flag("reward_up_heldout_down", "Training reward rising while held-out accuracy falls",
                f"reward/mean rose {w[0]:.3f} -> {w[1]:.3f} while eval/accuracy fell from its best {acc[best]:.3f} "
                f"(step {int(steps[best])}) to {acc[-1]:.3f} (step {int(steps[-1])}). The policy is learning what the "
                "training reward pays for, not the task: reward hacking or overfitting to the verifier.",
                (("eval.verifier", "a second, independent judge: health/verifier_disagreement"),
                 ("rewards", "tighten the verifier; check samples.jsonl for what it accepts"),
                 ("grpo.beta", "a KL coefficient keeps the policy near the reference"),
                 ("reward_control: random", "a spurious-reward control run: gains it matches are not from the reward"),
                 _best_checkpoint(int(steps[best]))))


def _heldout_regression(train, records) -> Flag | None:
    """Held-out accuracy well below its best without the training reward rising (that case is
    `_reward_vs_heldout`): the update is hurting the policy, whatever the reward says."""
    _, reward = series(train, "reward/mean")
    w = _windows(reward)
    steps, acc = series(records, "eval/accuracy")
    if acc.size < 2 or (w is not None and w[1] - w[0] >= REWARD_RISE):
        return None
    best = int(np.argmax(acc))
    if best == acc.size - 1 or acc[best] - acc[-1] < HELDOUT_REGRESSION:
        return None
    trend = f"; reward/mean {w[0]:.3f} -> {w[1]:.3f}" if w is not None else ""
    return Flag("heldout_regression", "Held-out accuracy fell",
                f"eval/accuracy fell from {acc[best]:.3f} (step {int(steps[best])}) to {acc[-1]:.3f} (step "
                f"{int(steps[-1])}){trend}. The updates are making the policy worse: a learning rate too high for "
                "the signal, rewards that carry no information about the task, or drift from the reference.",
                (("train.learning_rate", "lower"),
                 ("grpo.beta", "a KL coefficient keeps the policy near the reference"),
                 ("rewards", "do they reward the task? compare with a reward_control: random run"),
                 _best_checkpoint(int(steps[best]))))


def _verifier(records) -> Flag | None:
    _, dis = series(records, "health/verifier_disagreement")
    if not dis.size or dis[-1] < VERIFIER_DISAGREEMENT:
        return None
    return Flag("verifier_disagreement", "The two verifiers disagree",
                f"health/verifier_disagreement {dis[0]:.3f} at the first evaluation, {dis[-1]:.3f} at the last "
                f"(above {VERIFIER_DISAGREEMENT:.0%}): the training reward accepts answers the independent judge "
                "does not, or the reverse.",
                (("rewards", "align the training verifier with the independent one"),
                 ("eval.verifier", "the judge used")))


def _length_blowup(train) -> Flag | None:
    _, length = series(train, "completion/len_mean")
    _, trunc = series(train, "completion/truncated_frac")
    w, t = _windows(length), _windows(trunc)
    grew = w is not None and w[0] > 0 and w[1] > LENGTH_GROWTH * w[0]
    cut = t is not None and t[1] > TRUNCATED_MAX
    if not (grew or cut):
        return None
    parts = []
    if w is not None:
        parts.append(f"completion/len_mean {w[0]:.1f} -> {w[1]:.1f} tokens")
    if t is not None:
        parts.append(f"completion/truncated_frac {t[0]:.2f} -> {t[1]:.2f}")
    _, lc = series(train, "completion/len_correct")
    _, li = series(train, "completion/len_incorrect")
    if lc.size and li.size:
        parts.append(f"late correct / incorrect lengths {lc[-max(3, lc.size // 4):].mean():.1f} / "
                     f"{li[-max(3, li.size // 4):].mean():.1f}")
    return Flag("length_blowup", "Completion length blow-up",
                "; ".join(parts) + f" (flagged above {LENGTH_GROWTH}x growth or {TRUNCATED_MAX:.0%} truncated).",
                (("rewards: overlong", "DAPO's soft overlong penalty"), ("grpo.mask_truncated", "truncated samples out of the loss"),
                 ("grpo.loss_agg: seq_mean_token_sum_norm", "Dr. GRPO: no length bias"),
                 ("sampling.max_new_tokens", "the cap itself")))


def _kl_drift(train) -> Flag | None:
    _, kl = series(train, "kl/k3")
    w = _windows(kl)
    if w is None or w[1] < KL_MAX:
        return None
    return Flag("kl_drift", "KL drift from the reference",
                f"kl/k3 {w[0]:.3f} -> {w[1]:.3f} nats/token (above {KL_MAX}): the policy has moved far from the "
                "reference; gains may not transfer and the update is at risk of instability.",
                (("grpo.beta", "raise the KL coefficient"), ("train.learning_rate", "lower"),
                 ("grpo.epsilon_low, grpo.epsilon_high", "a tighter clip range")))


def _sampler_drift(train) -> Flag | None:
    _, mean = series(train, "health/sampler_train_logprob_diff")
    _, peak = series(train, "health/sampler_train_logprob_diff_max")
    if not mean.size:
        return None
    m, p = float(mean.mean()), float(peak.max()) if peak.size else 0.0
    if m < LOGPROB_DIFF_MEAN and p < LOGPROB_DIFF_MAX:
        return None
    return Flag("sampler_train_drift", "Sampler and trainer disagree on log-probs",
                f"health/sampler_train_logprob_diff mean {m:.4f} per token, max {p:.3f} (flagged above "
                f"{LOGPROB_DIFF_MEAN} / {LOGPROB_DIFF_MAX}): the samples come from a different policy than the "
                "one being updated, so the update is off-policy without saying so.",
                (("grpo.sampler_is_cap", "truncated importance sampling, e.g. 2.0"),
                 ("model.dtype: float32", "sample in the training precision")))


def _skipped(records) -> Flag | None:
    _, skipped = series(records, "train/skipped_steps")
    if not skipped.size or skipped.max() <= 0:
        return None
    return Flag("skipped_steps", "Skipped updates",
                f"train/skipped_steps reached {int(skipped.max())}: updates with a non-finite loss or gradient "
                "were dropped.",
                (("train.learning_rate", "lower"), ("train.max_grad_norm", "clip harder"),
                 ("model.param_dtype: float32", "float32 master weights"), ("rewards", "check for NaN or huge values")))


def diagnose(records: Sequence[Mapping[str, Any]]) -> list[Flag]:
    """The failure patterns `records` (metrics.jsonl rows) show, each with its evidence and knobs;
    an empty list for a healthy run (or one too short to judge trends: see MIN_STEPS)."""
    train = _train_records(records)
    checks = [_skipped(records)]
    if len(train) >= MIN_STEPS:
        checks += [_entropy_collapse(train), _dead_groups(train), _reward_vs_heldout(train, records),
                   _heldout_regression(train, records), _length_blowup(train), _kl_drift(train),
                   _sampler_drift(train)]
    checks.append(_verifier(records))
    return [f for f in checks if f is not None]


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
    ("KL to reference", [("kl/k3", "k3")]),
    ("Gradient noise scale (rows)", [("health/grad_noise_scale", "B_simple")]),
    ("Sampler vs trainer log-probs", [("health/sampler_train_logprob_diff", "mean |diff|"),
                                      ("health/sampler_train_logprob_diff_max", "max |diff|")]),
    ("Critic (PPO)", [("value/explained_variance", "explained variance"), ("value/loss", "value loss")]),
    ("Episodes: turns and tool calls", [("env/turns_mean", "model turns"), ("env/tool_calls_mean", "tool calls"),
                                        ("env/errors", "environment errors")]),
    ("Episode tokens", [("completion/model_tokens_mean", "model"), ("completion/env_tokens_mean", "environment")]),
)


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
        ax.plot(steps, vals, label=label, marker="o" if len(steps) <= 30 else None, markersize=3)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _config_summary(run_dir: Path) -> str:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return "no config.yaml in the run directory"
    try:
        config = load_config(path)
    except ConfigError as e:  # a hand-edited or older file: the report still shows the metrics
        return f"config.yaml does not load ({e})"
    g, t = config.grpo, config.train
    parts = [f"algorithm {config.algorithm}", f"reward_control {config.reward_control}",
             f"model {(config.model.path if config.model else None) or 'random init'}",
             f"G {config.sampling.group_size}",
             f"lr {t.learning_rate}", f"beta {g.beta}",
             f"epsilon {g.epsilon_low}/{g.epsilon_high}", f"loss_agg {g.loss_agg}",
             f"advantages {g.advantage_estimator}/{g.advantage_scale}"]
    return ", ".join(parts)


_STYLE = """body{font-family:system-ui,sans-serif;max-width:1250px;margin:24px auto;padding:0 16px;color:#222}
h1{font-size:1.5em}.flag{border-left:6px solid #c0392b;background:#fdf2f1;padding:8px 14px;margin:12px 0}
.ok{border-left:6px solid #27ae60;background:#eefaf2;padding:8px 14px}.flag h3{margin:4px 0}
.plots{display:flex;flex-wrap:wrap;gap:8px}.plots img{width:600px;border:1px solid #ddd}
table{border-collapse:collapse}td,th{padding:2px 10px;border-bottom:1px solid #eee;text-align:right}
code{background:#f4f4f4;padding:0 3px}"""


def render(run_dir: Path, records: Sequence[Mapping[str, Any]], flags: Sequence[Flag]) -> str:
    """The page's HTML."""
    e = html.escape
    train = _train_records(records)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>grpo-jax report: {e(run_dir.name)}</title>"
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>Run health: {e(str(run_dir))}</h1>",
             f"<p>{len(train)} train steps logged; {e(_config_summary(run_dir))}.</p>"]
    if len(train) < MIN_STEPS:
        parts.append(f"<p class='flag'>Only {len(train)} train steps: trends need at least {MIN_STEPS}; only "
                     "skipped updates and verifier disagreement were checked.</p>")
    parts.append(f"<h2 id='flags'>Flags ({len(flags)})</h2>")
    if not flags:
        parts.append("<p class='ok' id='no-flags'>No failure pattern found.</p>")
    for f in flags:
        knobs = "".join(f"<li><code>{e(key)}</code>: {e(why)}</li>" for key, why in f.knobs)
        parts.append(f"<div class='flag' data-flag='{e(f.key)}'><h3>{e(f.title)}</h3><p>{e(f.evidence)}</p>"
                     f"<p>What addresses it:</p><ul>{knobs}</ul></div>")
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
    parts.append("</div></body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out_path: str | Path | None = None) -> tuple[Path, list[Flag]]:
    """Write the report of `run_dir` (default `run_dir/report.html`) -> (its path, the flags)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no records yet: nothing to report")
    flags = diagnose(records)
    out = run_dir / REPORT_FILE if out_path is None else Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(run_dir, records, flags), encoding="utf-8")
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
