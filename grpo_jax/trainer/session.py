"""One run's lifecycle, the same for `grpo-jax train` (grpo_jax.trainer.loop) and `grpo-jax
train-rm` (grpo_jax.trainer.reward_run): what every run needs around its steps, written once.

    session = RunSession(run_dir, checkpoint=config.checkpoint, resume=config.train.resume)
    with session:                        # stop signals (SIGTERM, SIGINT) from the first input check
        ...check the inputs...
        with session.claim():            # the run directory's lock and its checkpointer
            steps = session.saved_steps()    # a directory with checkpoints is resumed or refused
            session.open(config, resuming=bool(steps))   # config.yaml (a resumed run keeps its own)
            writer = session.metrics_writer(resumed)     # the logs trimmed to the resumed step
            bar = session.progress(total, ...)
            hooks = [..., Hook(session.checkpoint_hook(save, every=..., last=...))]
            ... run_steps(...) ...
            return session.stopped(step) or the run's RunResult

The run directory may be `gs://...` (grpo_jax.runtime.storage: small files staged locally and
uploaded at every checkpoint, checkpoints written there by orbax). Several hosts: process 0 holds
the lock and writes the files and the progress bar; every process saves checkpoints.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import jax
import yaml

from grpo_jax.config import ConfigError, config_to_dict
from grpo_jax.observe import MetricsWriter, ProgressBar
from grpo_jax.observe.progress import POLICY_FIELDS
from grpo_jax.runtime.hosts import is_primary
from grpo_jax.runtime.run_lock import RunLock
from grpo_jax.runtime.storage import RunDirectory
from grpo_jax.trainer.checkpoint import Checkpointer
from grpo_jax.trainer.hooks import StepInfo
from grpo_jax.trainer.preemption import StopSignals, stop_report
from grpo_jax.trainer.run_state import RunResult


class RunSession:
    """The run directory (local or gs://), its lock, checkpointer, config.yaml, logs, progress bar,
    stop signals and the checkpoint hook of one run (see the module docstring). `log` takes the
    run's lines (default: above the progress bar, on stderr); on processes other than 0 it is
    silent."""

    def __init__(self, run_dir: str | Path, *, checkpoint, resume: bool, log: Callable[[str], None] | None = None):
        self.storage = RunDirectory(run_dir)
        self.run_dir: Path = self.storage.local  # where the files are written (staged, for gs://)
        self.resume, self.checkpoint_config = resume, checkpoint
        self.primary = is_primary()  # process 0 writes the run directory's files
        self.bar: ProgressBar | None = None
        self.log = log or (lambda line: self.bar.write(line) if self.bar else print(line, file=sys.stderr))
        if not self.primary:
            self.log = lambda line: None
        self.sync = self.storage.sync if self.primary else (lambda: None)  # upload the staged files (gs://)
        # Installed from the first input check to the last file (grpo_jax.trainer.preemption).
        self.signals = StopSignals(self.log, every_minutes=checkpoint.every_minutes, stage="setup")
        self.checkpointer: Checkpointer | None = None

    def __enter__(self) -> RunSession:
        self.signals.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.signals.__exit__(*exc)

    @contextlib.contextmanager
    def claim(self) -> Iterator[Checkpointer]:
        """One run per directory: process 0 holds its lock from before the checkpoint check to the
        end; the checkpointer is open meanwhile (its saves finished or failed when this ends)."""
        with RunLock(self.storage.target, log=self.log, hold=self.primary), \
                Checkpointer(self.storage.checkpoints, keep=self.checkpoint_config.keep, log=self.log) as checkpointer:
            self.checkpointer = checkpointer
            try:
                yield checkpointer
            finally:
                self.checkpointer = None

    def saved_steps(self) -> list[int]:
        """The saved steps, newest first; a directory that holds some is resumed (`train.resume:
        true`) or refused before anything is written."""
        steps = self.checkpointer.all_steps()
        if steps and not self.resume:
            raise ConfigError(f"{self.storage} already holds checkpoints (newest: step {steps[0]}); resume it "
                              "(train.resume: true) or choose another --output")
        return steps

    def open(self, config, *, resuming: bool) -> None:
        """The run directory made, with the resolved config as config.yaml (after the checkpoint
        check: a refused start leaves an existing directory as it was); a resumed run keeps the
        config.yaml it started with and says which settings of this restart differ."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_count() > 1 and not self.storage.remote:
            self.log(f"run directory {self.run_dir} is a local path: every host must see the same directory "
                     "(a shared file system), or each host's checkpoint shards land on its own disk; use gs://...")
        if self.storage.remote:
            self.log(f"run directory {self.storage}: checkpoints written there, logs staged in {self.run_dir} and "
                     "uploaded at every checkpoint")
        if self.primary:
            write_run_config(config, self.run_dir, resuming=resuming, log=self.log)

    def metrics_writer(self, resumed: int | None, *, trackers: Sequence = ()) -> MetricsWriter | None:
        """metrics.jsonl (and TensorBoard, `trackers`) of process 0, without what an interrupted
        run wrote after its checkpoint (`resumed`: the step it resumes after), or, on a fresh start,
        without the logs of an earlier start that stopped before its first checkpoint."""
        if not self.primary:
            return None
        writer = MetricsWriter(self.run_dir, trackers=trackers)
        if resumed is not None:
            writer.truncate_after(resumed)
        elif dropped := writer.start_over():
            self.log(f"{self.storage}: the logs of {dropped} steps of a start without a checkpoint are dropped")
        return writer

    def progress(self, total: int, *, initial: int, start: Mapping[str, float] | None, enabled: bool,
                 every: int = 1, fields: Sequence = POLICY_FIELDS) -> ProgressBar:
        """The progress bar (process 0's); the session's log lines go above it while it is open.
        `fields`: what it shows (observe.progress's; the policy's by default)."""
        self.bar = ProgressBar(total, enabled=enabled and self.primary, initial=initial, every=every, start=start,
                               fields=fields)
        return self.bar

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def checkpoint_hook(self, save: Callable[[StepInfo], None], *, every: int, last: int) -> Callable[[StepInfo], bool]:
        """The loop's checkpoint hook (run every step, on every host: a signal is looked for at
        every step): `save(info)` every `every` steps, at step `last`, and when the stop signals
        say a signal arrived or the clock made a checkpoint due; then the staged files are
        uploaded. Returns True (stop after this step) after a signal. A save that failed since
        the last step raises CheckpointError here."""

        def hook(info: StepInfo) -> bool:
            self.checkpointer.check()
            stop, due = self.signals.check(info.step)
            if stop or due or every and info.step % every == 0 or info.step == last:
                save(info)
                self.sync()
                self.signals.saved()
            return stop

        return hook

    def stopped(self, step: int | None, *, steps: int, resuming: bool = False) -> RunResult:
        """After a stop signal (or user code that failed beyond use: RunFailed): the step's
        checkpoint (if any) complete on storage, one line on how to go on."""
        self.checkpointer.wait()
        self.sync()
        stop_report(self.signals.received, step=step, steps=steps, where=str(self.storage), resuming=resuming,
                    log=self.log, failure=self.signals.failure)
        return RunResult(run_dir=str(self.storage), stopped=self.signals.received or "a stop on another host",
                         step=step)


def write_run_config(config, run_dir: Path, *, resuming: bool, log: Callable[[str], None]) -> None:
    """`run_dir/config.yaml`: the resolved config (a RunConfig or RMRunConfig) of a fresh start; a
    resumed run keeps the one it started with, and says which settings of this restart differ."""
    saved, now = run_dir / "config.yaml", config_to_dict(config)
    text = yaml.safe_dump(now, sort_keys=False)
    if not (resuming and saved.exists()):
        saved.write_text(text)
    elif saved.read_text() != text:
        before = yaml.safe_load(saved.read_text()) or {}
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        log(f"config.yaml kept as the run started it; this restart's settings differ in: {', '.join(changed)}")
