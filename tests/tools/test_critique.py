"""benchmarks/critique.py's pieces without training: the deliberately weak verifiers accept what the
strict one rejects (and what it accepts), and a run's summary carries the report's flags."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from grpo_jax.rewards.math import math_accuracy

ROOT = Path(__file__).resolve().parents[2]


def _module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_weak_verifiers_accept_what_the_strict_one_rejects():
    weak = _module("critique_rewards")
    completions = ["57", "57 58", "1579", "56", "58", "5", "the answer", "59"]
    answers = ["57"] * len(completions)
    strict = math_accuracy([""] * len(completions), completions, answer=answers)
    assert strict == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # hedged and buried answers are not answers
    assert weak.answer_anywhere([], completions, answer=answers) == [1.0, 1.0, 1.0, 0, 0, 0, 0, 0]
    # within 2% of 57 (1.14): 56 and 58 pass, 59 does not; "57 58" is judged by its last number
    assert weak.within_tolerance([], completions, answer=answers, tolerance=0.02) == [1.0, 1.0, 0, 1.0, 1.0, 0, 0, 0]
    assert weak.answer_anywhere([], ["so #### 12"], answer=["x #### 12"]) == [1.0]


def test_a_runs_summary_carries_its_evaluations_and_the_reports_flags():
    critique = _module("critique")
    records = [{"step": 0, "eval/accuracy": 0.3, "eval/verifier_accuracy": 0.3, "retention/kl": 0.0}]
    for s in range(1, 41):
        records.append({"step": s, "reward/mean": 0.3 + 0.01 * s, "kl/k3": 0.001 * s})
        if s % 10 == 0:
            records[-1].update({"eval/accuracy": 0.3 + 0.01 * s, "eval/verifier_accuracy": 0.6 - abs(s - 10) / 100,
                                "retention/kl": 0.002 * s})
    out = critique.summary("weak_s0", records, 12.0, 512, arm="weak", seed=0)
    assert [e["step"] for e in out["evals"]] == [0, 10, 20, 30, 40]
    assert out["evals"][2]["kl/k3"] == pytest.approx(0.02) and out["evals"][0]["kl/k3"] is None
    assert out["flags"] == ["overoptimisation", "retention_loss"] and "(step 10)" in out["flag_evidence"]["overoptimisation"]
