"""A preemption notice (SIGTERM) ends the step in flight, saves it and exits 0; the same command
then resumes, and the run ends exactly where an uninterrupted one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from runs import CONFIG, assert_same_run, write_config

from grpo_jax import cli
from grpo_jax.observe.writers import read_metrics

STEPS = 30


def _config(tmp_path):
    return {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")}, "sft": {"steps": 0},
            "train": {**CONFIG["train"], "steps": STEPS, "samples_every": 0},
            "eval": {"every": 0, "num_prompts": 8, "k": 2}, "checkpoint": {"every": 0, "every_minutes": 0}}


def test_sigterm_saves_the_step_exits_0_and_the_rerun_matches_an_uninterrupted_run(tmp_path):
    path = write_config(tmp_path, _config(tmp_path))
    out = tmp_path / "preempted"
    proc = subprocess.Popen([sys.executable, "-m", "grpo_jax", "train", "--config", path, "--output", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and sum('"train/loss"' in line for line in metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached step 2"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    stopped = summary["step"]
    assert summary["stopped"] == "SIGTERM" and 2 <= stopped < STEPS, summary
    assert "received SIGTERM: finishing this step" in stderr
    assert f"stopped by SIGTERM after step {stopped} of {STEPS}: its checkpoint is in" in stderr
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [stopped]
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == list(range(1, stopped + 1))

    # The same command again resumes from that step and finishes the run.
    assert cli.main(["train", "--config", path, "--output", str(out)]) == 0
    reference = tmp_path / "uninterrupted"
    assert cli.main(["train", "--config", path, "--output", str(reference)]) == 0
    assert_same_run(reference, out)  # each step logged once


def test_a_second_signal_aborts_at_once():
    script = textwrap.dedent("""
        import os, signal, sys, time
        from grpo_jax.trainer.preemption import StopSignals
        with StopSignals(lambda line: print(line, flush=True)) as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            assert signals.received == "SIGTERM" and signals.check(1) == (True, False)
            print("still running", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            print("not reached", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert "received SIGTERM: finishing this step" in proc.stdout
    assert "still running" in proc.stdout and "aborting now, without a checkpoint" in proc.stdout
    assert "not reached" not in proc.stdout


def test_the_clock_makes_a_checkpoint_due(monkeypatch):
    from grpo_jax.trainer import preemption

    now = [1000.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: now[0])
    signals = preemption.StopSignals(lambda line: None, every_minutes=30)
    assert signals.check(1) == (False, False)
    now[0] += 30 * 60
    assert signals.check(2) == (False, True)
    signals.saved()
    assert signals.check(3) == (False, False)
    assert preemption.StopSignals(lambda line: None, every_minutes=0).check(1) == (False, False)
