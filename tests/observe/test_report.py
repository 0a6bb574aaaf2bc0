"""`grpo-jax report` (issue 15): synthetic run directories built to show one failure each are
flagged for it (with evidence and knobs), a healthy one is flagged for nothing; the page is one
self-contained HTML file. The headless-browser check is marked `browser` (run with -m browser where
Chromium is installed; see the README)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from grpo_jax.observe.writers import MetricsWriter
from grpo_jax.observe.report import diagnose, screenshot, write_report


def healthy_records(steps: int = 60, seed: int = 0) -> list[dict]:
    """A run that learns: reward and held-out accuracy rise together, entropy eases slowly, dead
    groups near what the pass rate predicts, lengths steady, small KL, no drift, no skips."""
    rng = np.random.default_rng(seed)
    records = [{"step": 0, "eval/accuracy": 0.30, "eval/pass@k": 0.6}]
    for s in range(1, steps + 1):
        p = 0.3 + 0.4 * s / steps + rng.normal(0, 0.02)
        r = {"step": s, "reward/mean": p, "policy/entropy": 1.0 - 0.3 * s / steps + rng.normal(0, 0.01),
             "health/distinct_answers": 4.0 - s / steps, "groups/frac_zero_std": p**8 + (1 - p) ** 8 + 0.05,
             "health/frac_zero_std_expected": p**8 + (1 - p) ** 8, "groups/frac_all_correct": p**8,
             "groups/frac_all_wrong": (1 - p) ** 8, "completion/len_mean": 20 + rng.normal(0, 1),
             "completion/truncated_frac": 0.01, "kl/k3": 0.02 * s / steps, "train/skipped_steps": 0,
             "health/sampler_train_logprob_diff": 2e-7, "health/sampler_train_logprob_diff_max": 3e-6,
             "health/grad_noise_scale": 100.0 + rng.normal(0, 10)}
        if s % 10 == 0:  # a gold judge that agrees, and a policy that stays near its start on general text
            r.update({"eval/accuracy": 0.3 + 0.4 * s / steps, "eval/pass@k": 0.6 + 0.3 * s / steps,
                      "eval/verifier_reward_mean": 0.28 + 0.4 * s / steps, "retention/kl": 0.02 * s / steps,
                      "retention/general_nll": 3.0 + 0.03 * s / steps})
        records.append(r)
    return records


def _write(tmp_path, name, records):
    run = tmp_path / name
    with MetricsWriter(run, tensorboard=False) as w:
        for r in records:
            w.write(r["step"], {k: v for k, v in r.items() if k != "step"})
    return run


def test_a_healthy_run_is_flagged_for_nothing(tmp_path):
    run = _write(tmp_path, "healthy", healthy_records())
    path, flags = write_report(run_dir=run)
    assert flags == []
    page = path.read_text()
    assert "id='no-flags'" in page and "data-flag=" not in page
    assert page.count("data:image/png;base64,") >= 6  # the plots travel inside the page


def test_entropy_collapse_is_flagged_with_its_evidence(tmp_path):
    records = healthy_records()
    for r in records[1:]:
        if "policy/entropy" in r:
            r["policy/entropy"] = 1.0 * np.exp(-r["step"] / 8)
            r["health/distinct_answers"] = max(1.0, 4.0 - r["step"] / 5)
    run = _write(tmp_path, "collapse", records)
    path, flags = write_report(run_dir=run)
    assert [f.key for f in flags] == ["entropy_collapse"]
    assert "policy/entropy fell from" in flags[0].evidence and "distinct answers" in flags[0].evidence
    keys = [key for key, _ in flags[0].knobs]
    assert "grpo.entropy_coef" in keys and "grpo.epsilon_high" in keys
    assert "data-flag='entropy_collapse'" in path.read_text()


def test_reward_up_while_heldout_accuracy_falls_is_flagged(tmp_path):
    records = healthy_records()
    for r in records:
        if "eval/accuracy" in r and r["step"] > 10:
            r["eval/accuracy"] = 0.36 - 0.2 * (r["step"] - 10) / 50  # peaks at step 10 (0.367), then falls
    run = _write(tmp_path, "hacked", records)
    _, flags = write_report(run_dir=run)
    assert [f.key for f in flags] == ["reward_up_heldout_down"]
    assert "step 10" in flags[0].evidence
    keys = [key for key, _ in flags[0].knobs]
    assert "eval.verifier" in keys and "grpo.beta" in keys and "checkpoints/10" in keys


@pytest.mark.parametrize("key, change", [
    ("dead_groups", lambda r: r.update({"groups/frac_zero_std": 0.7, "groups/frac_all_correct": 0.5})),
    ("length_blowup", lambda r: r.update({"completion/len_mean": 20 + 2 * r["step"]})),
    ("kl_drift", lambda r: r.update({"kl/k3": 0.05 * r["step"]})),
    ("sampler_train_drift", lambda r: r.update({"health/sampler_train_logprob_diff": 0.05,
                                                "health/sampler_train_logprob_diff_max": 2.0})),
    ("skipped_steps", lambda r: r.update({"train/skipped_steps": 1 if r["step"] > 30 else 0})),
    ("heldout_regression", lambda r: r.update({"reward/mean": 0.3, **({"eval/accuracy": 0.45 - 0.005 * r["step"]}
                                                                     if "eval/accuracy" in r else {})})),
])
def test_each_other_pattern_is_flagged_alone(tmp_path, key, change):
    records = healthy_records()
    for r in records[1:]:
        change(r)
    _, flags = write_report(run_dir=_write(tmp_path, key, records))
    assert [f.key for f in flags] == [key]
    assert flags[0].knobs


def test_a_short_run_is_not_judged_on_trends():
    records = healthy_records(steps=5)
    for r in records[1:]:
        r["policy/entropy"] = 0.001
    assert diagnose(records) == []


def test_the_cli_writes_the_report_and_names_the_flags(tmp_path):
    records = healthy_records()
    for r in records[1:]:
        r["kl/k3"] = 0.05 * r["step"]
    run = _write(tmp_path, "cli", records)
    out = tmp_path / "page.html"
    proc = subprocess.run([sys.executable, "-m", "grpo_jax", "report", str(run), "--out", str(out)],
                          capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"report": str(out), "flags": ["kl_drift"],
                                                                "notices": []}
    assert "flag: KL drift" in proc.stderr
    missing = subprocess.run([sys.executable, "-m", "grpo_jax", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "no metrics.jsonl" in missing.stderr


@pytest.mark.browser
def test_headless_chromium_renders_the_report(tmp_path):
    records = healthy_records()
    for r in records[1:]:
        r["policy/entropy"] = np.exp(-r["step"] / 8)
    path, _ = write_report(run_dir=_write(tmp_path, "shown", records))
    png = screenshot(path, tmp_path / "shot.png", height=1200)
    from PIL import Image

    image = np.asarray(Image.open(png).convert("RGB"), np.int32)
    assert image.shape[:2] == (1200, 1300)
    # The flag's box is drawn in its red border colour (#c0392b), and the page is not blank.
    assert np.any(np.all(np.abs(image - [0xC0, 0x39, 0x2B]) < 8, axis=-1))
    assert image.std() > 20


def _eval_steps(r, values):
    if "eval/accuracy" in r:
        r.update(values(r["step"]))


@pytest.mark.parametrize("key, change", [
    ("entropy_falling", lambda r: r.update({"policy/entropy": 1.0 - 0.55 * r["step"] / 60})),
    ("dead_groups_share", lambda r: r.update({"groups/frac_zero_std": 0.28})),
    ("sampler_drift_rising", lambda r: r.update({"health/sampler_train_logprob_diff": 1e-4 * (1 + r["step"] / 6)})),
    ("verifier_accuracy_falling", lambda r: _eval_steps(r, lambda s: {"eval/verifier_reward_mean": 0.6 - abs(s - 20) / 1000})),
    ("retention_loss", lambda r: _eval_steps(r, lambda s: {"retention/kl": 0.08 * s / 60})),
    ("retention_loss", lambda r: _eval_steps(r, lambda s: {"retention/general_nll": 3.0 + 0.08 * s / 60})),
    ("heldout_below_best", lambda r: r.update({"reward/mean": 0.5}) or _eval_steps(
        r, lambda s: {"eval/accuracy": 0.7 if s == 30 else 0.62})),
])
def test_each_notice_is_raised_alone_below_the_failures(key, change):
    records = healthy_records()
    for r in records[1:]:
        change(r)
    flags = diagnose(records, eval_samples=400)
    assert [(f.key, f.level) for f in flags] == [(key, "notice")], flags
    if key == "heldout_below_best":  # 0.08 below its best: 2.4 standard errors at 400 samples, 0.5 at 20
        assert "2.4 standard errors" in flags[0].evidence and diagnose(records, eval_samples=20) == []


def test_the_page_states_its_thresholds_shows_samples_and_smoothed_curves(tmp_path):
    from grpo_jax.observe.health_checks import THRESHOLDS
    from grpo_jax.observe.report import ema

    records = healthy_records()
    for r in records[1:]:
        r.update({"groups/frac_zero_std": 0.28, "train/loss": 0.1, "train/grad_norm": 1.0,
                  "perf/sample_tokens_per_s": 1000.0, "perf/step_s": 2.0})
    run = _write(tmp_path, "notices", records)
    with MetricsWriter(run, tensorboard=False) as w:
        for step in (10, 20, 30, 40):
            w.write_samples(step, [{"prompt": f"p{step}<b>", "completion": f"c{step}", "reward": 0.5}])
    (run / "config.yaml").write_text("train: {learning_rate: 0.001, warmup_steps: 10, steps: 60}\n")
    path, flags = write_report(run_dir=run)
    page = path.read_text()
    assert [f.key for f in flags] == ["dead_groups_share"] and "data-notice='dead_groups_share'" in page
    assert "id='no-flags'" in page and "Notices (1)" in page
    assert all(f"<code>{key}</code>" in page for key, _, _ in THRESHOLDS) and "above 25%" in page
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)  # the plots' bytes may spell anything
    assert "p10&lt;b&gt;" in text and "c30" in text and "c40" in text and "c20" not in text  # first, middle, last
    assert "alt='Learning rate'" in page and "alt='Throughput (tokens/s)'" in page and "alt='Loss'" in page
    np.testing.assert_allclose(ema(np.array([1.0, np.nan, 2.0, 2.0]), 0.5), [1.0, 1.0, 1.5, 1.75])


def test_overoptimisation_is_flagged_with_the_kl_at_the_gold_peak_and_only_beyond_the_noise():
    """The proxy (reward/mean) rises all run; the gold judge peaks at step 20 and falls."""
    records = healthy_records()
    for r in records[1:]:
        r["kl/k3"] = 0.002 * r["step"]
        _eval_steps(r, lambda s: {"eval/verifier_reward_mean": 0.6 - abs(s - 20) / 200})  # 0.6 at 20, 0.4 at 60
    flags = diagnose(records, eval_samples=400)
    assert [(f.key, f.level) for f in flags] == [("overoptimisation", "failure")], flags
    ev = flags[0].evidence
    assert "fell from 0.600 (step 20) to 0.400 (step 60)" in ev and "kl/k3 0.0310 -> 0.1110" in ev  # the means of steps 11-20 and 51-60
    assert "retention/kl 0.0067 -> 0.0200" in ev
    assert dict(flags[0].knobs)["checkpoints/20"] and "grpo.beta" in dict(flags[0].knobs)
    # 0.2 below the peak is within 2 standard errors of 10 samples per evaluation: only the notice
    assert [f.key for f in diagnose(records, eval_samples=10)] == ["verifier_accuracy_falling"]
    for r in records[1:]:  # a proxy that stops rising: the gold's fall is not over-optimisation
        r["reward/mean"] = 0.5
    assert "overoptimisation" not in [f.key for f in diagnose(records, eval_samples=400)]
