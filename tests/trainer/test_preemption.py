"""A preemption notice (SIGTERM) ends the step in flight, saves it and exits 0; the same command
then resumes, and the run ends exactly where an uninterrupted one does. A signal before the first
step stops the run, saving nothing, and one after the last step lets it finish, even once the run
has returned and the process is exiting: exit 0 either way, with every checkpoint it reports complete."""

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
from grpo_jax.trainer.run_state import RunResult

STEPS = 30


def _config(tmp_path):
    return {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")}, "sft": {"steps": 0},
            "train": {**CONFIG["train"], "steps": STEPS, "samples_every": 0},
            # retention: the resumed run reads pi_0's reference back, so its final KL is the uninterrupted one's
            "eval": {"every": 0, "num_prompts": 8, "k": 2, "retention": True, "retention_top_k": 8,
                     "retention_max_tokens": 16}, "checkpoint": {"every": 0, "every_minutes": 0}}


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
    assert read_metrics(out)[-1]["retention/kl"] > 0


def sigterm_in(monkeypatch, *targets, call: int = 1) -> None:
    """Deliver SIGTERM from inside the `call`-th call (counted over `targets`, (owner, name) pairs)
    of the functions named, before it runs, as the signal would be (the installed handler, called in
    the main thread): it lands at that moment however fast the machine, and without handlers
    installed there (SIG_DFL: not callable) the test fails instead of the process dying."""
    calls = []

    def wrap(original, name):
        def patched(*args, **kwargs):
            calls.append(name)
            if len(calls) == call:
                handler = signal.getsignal(signal.SIGTERM)
                assert callable(handler) and handler.__self__.received is None, f"no stop handler in {name}"
                handler(signal.SIGTERM, None)
            return original(*args, **kwargs)
        return patched

    for owner, name in targets:
        monkeypatch.setattr(owner, name, wrap(getattr(owner, name), name))


def _signalled_train(monkeypatch, capsys, args: list[str], *targets, call: int = 1) -> tuple[dict, str]:
    """`grpo-jax train ARGS` with SIGTERM delivered in `targets` -> (its summary line, its log)."""
    with monkeypatch.context() as patch:
        sigterm_in(patch, *targets, call=call)
        capsys.readouterr()
        assert cli.main(["train", *args]) == 0
    out, err = capsys.readouterr()
    assert "received SIGTERM" in err, err
    return json.loads(out.strip().splitlines()[-1]), err


def _complete_checkpoints(out) -> list[int]:
    """The saved steps, after checking that none is partial (orbax's *.orbax-checkpoint-tmp*)."""
    entries = [p.name for p in (out / "checkpoints").iterdir()]
    assert not [e for e in entries if "tmp" in e], entries
    return sorted(int(e) for e in entries if e.isdigit())


def _rerun_finds_nothing_to_do(args: list[str], steps: int, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["train", *args]) == 0
    out, err = capsys.readouterr()
    assert f"the run already reached train.steps={steps}, nothing left to train" in err, err
    assert "damaged" not in err, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert {"eval_accuracy_start", "eval_accuracy_end", "plot"} <= set(summary), summary


def test_a_signal_before_the_first_step_saves_nothing_and_one_after_the_last_lets_the_run_finish(
        tmp_path, monkeypatch, capsys):
    """One run directory through three signalled runs: in the warm start (stops, nothing saved),
    then afresh with a signal in the final evaluation, then extended by a step with a signal while
    its last checkpoint commits; each exits 0, and a rerun finds nothing to do."""
    from grpo_jax.trainer import checkpoint, loop, warm_start

    config = _config(tmp_path)
    config["train"]["steps"] = 1
    out = tmp_path / "run"
    args = ["--config", write_config(tmp_path, config), "--output", str(out)]

    summary, err = _signalled_train(monkeypatch, capsys, [*args, "--set", "sft.steps=2"],
                                    (warm_start, "warm_start_optimizer"))  # before the warm start's first step
    assert "received SIGTERM: stopping before the first step, without saving" in err
    assert "stopped by SIGTERM before the first checkpoint: nothing was saved yet" in err
    assert "sft step" not in err and summary == {"stopped": "SIGTERM", "step": None, "run_dir": str(out)}
    assert _complete_checkpoints(out) == [] and not (out / "metrics.jsonl").exists()

    # The same command starts afresh; a signal in its final evaluation (the second): the run finishes.
    summary, err = _signalled_train(monkeypatch, capsys, args, (loop, "evaluate_run"), call=2)
    assert "received SIGTERM: finishing this step, then saving a checkpoint" in err
    assert "eval_accuracy_end" in summary and (out / "metrics.png").exists()
    assert _complete_checkpoints(out) == [1]
    assert [r["step"] for r in read_metrics(out)] == [0, 1]  # each logged once
    _rerun_finds_nothing_to_do(args, 1, capsys)

    # One more step; the signal lands while its checkpoint commits (orbax saves asynchronously).
    args = [*args, "--set", "train.steps=2"]
    summary, err = _signalled_train(monkeypatch, capsys, args, (checkpoint.Checkpointer, "wait"),
                                    (checkpoint.Checkpointer, "close"))
    assert "received SIGTERM: the last step is done: finishing its checkpoint and the run's files" in err
    assert "eval_accuracy_end" in summary
    assert _complete_checkpoints(out) == [1, 2]
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]
    _rerun_finds_nothing_to_do(args, 2, capsys)


def test_a_signal_after_the_run_returned_is_acknowledged_and_the_command_exits_0(tmp_path, monkeypatch, capsys):
    """The run's handlers go when it returns; the process then prints its summary and tears JAX
    down (about a second), where a preemption notice ended a finished run with status -SIGTERM."""
    from grpo_jax.trainer import loop

    path, out = write_config(tmp_path, _config(tmp_path)), str(tmp_path / "run")
    script = textwrap.dedent(f"""
        import atexit, os, signal, sys, time
        from grpo_jax.trainer import loop, preemption
        from grpo_jax.trainer.run_state import RunResult

        # Registered before the command's own exit handler, so it runs after it: a signal during
        # the interpreter's exit is ignored (Python resets its own handlers while it tears down).
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))

        def train(config, run_dir):  # returns as a finished run does: its checkpoint done, its handlers gone
            with preemption.StopSignals(print, stage="finish"):
                pass
            return RunResult(eval_start={{"eval/accuracy": 0.0, "eval/pass@k": 0.0}}, plot=None,
                             eval_end={{"eval/accuracy": 0.5, "eval/pass@k": 1.0}}, run_dir=str(run_dir))

        loop.train = train
        from grpo_jax.cli import main
        sys.argv = ["grpo-jax", "train", "--config", {path!r}, "--output", {out!r}]
        status = main()
        os.kill(os.getpid(), signal.SIGTERM)  # the command has returned; the process has not exited
        time.sleep(0.2)
        print("exiting", flush=True)
        raise SystemExit(status)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines() == ["received SIGTERM after the run finished: its checkpoint and files are "
                                        "complete; exiting (send SIGTERM again to abort at once)"]
    assert '"eval_accuracy_end": 0.5' in proc.stdout and proc.stdout.endswith("exiting\n")

    # Called in a process of its own caller's (a test, a notebook), the command leaves its handlers as they were.
    monkeypatch.setattr(loop, "train", lambda config, run_dir: RunResult(stopped="SIGTERM", step=1, run_dir=out))
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert cli.main(["train", "--config", path, "--output", out]) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


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


def test_sigterm_while_a_user_reward_runs_saves_the_step_without_waiting_for_it(tmp_path, capsys):
    """A user reward that would take 10 minutes sends SIGTERM to the trainer (so the signal lands
    while the trainer waits on it): the wait ends at once, the step's samples are dropped and
    counted, the step is saved and the run exits 0, as for a signal anywhere else in a step."""
    (tmp_path / "slow_reward.py").write_text(
        "import os, signal, time\n"
        "def slow(prompts, completions, **fields):\n"
        "    os.kill(os.getppid(), signal.SIGTERM)  # the worker's parent: the trainer\n"
        "    time.sleep(600)\n")
    slow = f"{tmp_path / 'slow_reward.py'}:slow"
    config = {**_config(tmp_path), "rewards": [{"name": "math_accuracy"}, {"name": slow}],
              "eval": {"every": 0, "num_prompts": 8, "k": 2, "reward": "math_accuracy"}}
    out = tmp_path / "run"
    start = time.monotonic()
    assert cli.main(["train", "--config", write_config(tmp_path, config), "--output", str(out)]) == 0
    assert time.monotonic() - start < 120
    stdout, stderr = capsys.readouterr()
    assert json.loads(stdout.strip().splitlines()[-1])["step"] == 1
    assert f"stopped by SIGTERM after step 1 of {STEPS}: its checkpoint is in" in stderr
    assert _complete_checkpoints(out) == [1]
    step = [r for r in read_metrics(out) if "train/loss" in r]
    assert len(step) == 1 and step[0][f"reward/{slow}/failures"] == 256 and step[0]["reward/dropped"] == 256
