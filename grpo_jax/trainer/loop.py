"""The training loop: for each step, `trajectories = source.next(step)`, `state, metrics =
learner.update(state, trajectories)`, `source.sync(learner.params(state))`, then the hooks
(reward watch, evaluation, logging, checkpoints and preemption). `run_steps` is that loop alone,
over any rollout source and learner; `Trainer` builds a run's pieces and hooks around it.

Where each part lives: inputs checked before any compile, `trainer.prepare`; the pieces (policy,
warm start, LoRA base, learner, rollout source), `trainer.setup`; which checkpoint to resume,
`trainer.resume`; checkpoints, `trainer.checkpoint`; SIGTERM/SIGINT, `trainer.preemption`; the
rollout source, `rollout.source` (`rollout.pipeline`); the learner, `learner.learner`; rewards.watch.

Files in the run directory: `config.yaml`, `model/` (architecture + tokenizer), `metrics.jsonl`,
`samples.jsonl`, `tensorboard/`, `checkpoints/<step>/`, `metrics.png` (at the end).

Several hosts (`distributed.enabled`): every process runs this same loop. Each samples and scores
its block of every batch (the source puts the rows together on the mesh and the metrics over
hosts), so every process sees the same metrics. Only process 0 writes the run directory's files
and the progress bar; every process takes part in saving checkpoints (orbax writes each process's
shards), so the run directory must be on storage all hosts share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpo_jax.config import RunConfig, config_to_dict
from grpo_jax.learner.feed import StepSource
from grpo_jax.observe import MetricsWriter, ProgressBar, plot_run, read_metrics
from grpo_jax.observe.trackers import open_trackers
from grpo_jax.rewards.watch import RewardWatch
from grpo_jax.rollout.evaluation import evaluate_run
from grpo_jax.runtime.hosts import any_host
from grpo_jax.trainer.checkpoint import Checkpointer, save_step
from grpo_jax.trainer.hooks import Hook, MetricHook, StepInfo
from grpo_jax.trainer.preemption import StoppedBeforeStart, StopSignals
from grpo_jax.trainer.prepare import Prepared, model_json, prepare, write_model_files
from grpo_jax.trainer.resume import restore_state, resumable_steps
from grpo_jax.trainer.run_state import RunResult
from grpo_jax.trainer.session import RunSession
from grpo_jax.trainer.setup import Built, build


def run_steps(source: StepSource, learner, state, steps: range, hooks: Sequence[Hook]):
    """The loop -> (state, the step it stopped after when a hook asked to stop early, else None).
    `learner`: a grpo_jax.learner.Learner (or the reward-model trainer's, or anything with their
    `update(state, batch, while_waiting) -> (state, metrics)` and `params(state)`); it calls
    `while_waiting()` (the source's `ahead`) once its update is dispatched. The hooks run in
    order, each when due."""
    for step in steps:
        t0 = time.perf_counter()
        batch = source.next(step)
        state, metrics = learner.update(state, batch, while_waiting=source.ahead)
        source.sync(learner.params(state))
        metrics = {**metrics, **batch.metrics, "perf/step_s": time.perf_counter() - t0}
        info = StepInfo(step=step, state=state, batch=batch, metrics=metrics, last=step == steps[-1])
        stop = False
        for hook in hooks:
            if hook.due(info):
                stop = bool(hook.fn(info)) or stop
        if stop and not info.last:
            return state, step
    return state, None


class Trainer:
    def __init__(self, config: RunConfig, run_dir: str | Path, *, hooks: Sequence[MetricHook] = (),
                 log: Callable[[str], None] | None = None):
        # Lock, run directory (gs:// too), config.yaml, logs, progress bar, stop signals and the
        # checkpoint hook: the lifecycle train-rm shares (grpo_jax.trainer.session).
        self.session = RunSession(run_dir, checkpoint=config.checkpoint, resume=config.train.resume, log=log)
        self.config, self.storage, self.run_dir = config, self.session.storage, self.session.run_dir
        self.hooks, self.log, self.primary = list(hooks), self.session.log, self.session.primary
        self.prepared: Prepared | None = None  # every input check, before any compile (by `run`)
        self.evals: list[tuple[int, dict]] = []  # (step, eval metrics), for the summary
        self.rewards: list[float] = []  # each step's reward/mean
        self.writer: MetricsWriter | None = None
        self.built: Built | None = None
        self.state = None

    @property
    def signals(self) -> StopSignals:
        return self.session.signals

    def run(self) -> RunResult:
        with self.session:
            self.prepared = prepare(self.config)
            for note in self.prepared.notes:
                self.log(note)
            with self.session.claim() as checkpointer:
                return self._start_or_resume(checkpointer)

    def _start_or_resume(self, checkpointer: Checkpointer) -> RunResult:
        candidates = []
        try:
            if steps := self.session.saved_steps():  # every reason to refuse the restart is found before anything is written
                if self.primary:
                    self.storage.pull()  # a remote run's model/config.json, to compare
                candidates = resumable_steps(checkpointer, steps, prepared=self.prepared, run_dir=self.run_dir,
                                             model_json=model_json(self.prepared), where=str(self.storage),
                                             warn=self.log)
            self.signals.stop_point()  # before anything is written
            self.session.open(self.config, resuming=bool(candidates))
            if self.primary:
                write_model_files(self.prepared, self.run_dir / "model")
            return self._run(checkpointer, candidates)
        except StoppedBeforeStart:
            return self.session.stopped(None, steps=self.config.train.steps, resuming=bool(candidates))

    def _start(self, checkpointer: Checkpointer, candidates: list[int]) -> tuple[Any, int | None]:
        """(state, the step it resumes after) with the pieces built and the evaluations so far (a
        fresh run's at step 0); a stop signal meanwhile stops the run here (StoppedBeforeStart)."""
        saved_base = checkpointer.restore_meta(candidates[0]).base if candidates else None
        self.built = b = build(self.prepared, run_dir=self.run_dir, saved_base=saved_base,
                               resuming=bool(candidates), log=self.log)
        state, resume_from = b.state, None
        if candidates:
            state, resume_from = restore_state(checkpointer, candidates, b.learner.unplace(state), learner=b.learner,
                                               prepared=self.prepared, where=str(self.storage), warn=self.log,
                                               source=b.source)
            state = b.learner.place(state)
            self.log(f"resumed from the checkpoint of step {resume_from} in {self.storage}"
                     + (f"; the run already reached train.steps={self.config.train.steps}, nothing left to train"
                        if resume_from >= self.config.train.steps else ""))
        self.signals.stop_point()
        b.source.sync(b.learner.params(state))
        self.evals = self._past_evals(resume_from)
        if (retention := self.prepared.eval.retention) is not None:  # eval.retention: pi_0 kept, or read back
            retention.begin(b.source.model, self.run_dir, resumed=resume_from is not None, primary=self.primary,
                            log=self.log)
        if resume_from is None:
            self.evals.append((0, self._evaluate(0)))
            self.signals.stop_point()  # before it is logged: a run stopped here leaves no logs to repeat
        self.signals.stage = "steps"  # from here a signal ends the step in flight, and it is saved
        return state, resume_from

    def _run(self, checkpointer: Checkpointer, candidates: list[int]) -> RunResult:
        cfg, signals, session = self.config, self.signals, self.session
        state, resume_from = self._start(checkpointer, candidates)
        b, first = self.built, (resume_from or 0) + 1
        self.writer = session.metrics_writer(resume_from, trackers=open_trackers(
            cfg.log, self.run_dir, config_to_dict(cfg), log=self.log) if self.primary else ())
        if self.writer is not None and resume_from is None:
            self.writer.write(0, self.evals[0][1])
        bar = session.progress(cfg.train.steps, enabled=cfg.train.progress, initial=min(first - 1, cfg.train.steps),
                               every=cfg.log.every, start=self.evals[-1][1] if self.evals else None)
        watch = RewardWatch(self.prepared.rollout.rewards, rows=cfg.data.prompts_per_step * cfg.sampling.group_size,
                            max_failure_steps=cfg.train.max_reward_failure_steps, log=self.log)
        def save(info: StepInfo) -> None:
            save_step(checkpointer, info.step, b.learner.unplace(info.state), components=b.source.components(),
                      seed=cfg.train.seed, reference=b.learner.reference, base=b.base, source=b.source)

        hooks = [Hook(lambda i: signals.fail(watch.check(i.step, i.metrics, i.batch.log.first.rewards.messages,
                                                         i.batch.log.first.env_error))),
                 Hook(self._evaluate_hook, every=cfg.eval.every, at_last=True),
                 Hook(self._write_metrics), Hook(self._write_samples, every=cfg.train.samples_every),
                 Hook(lambda i: self._tell(i, bar)),
                 Hook(session.checkpoint_hook(save, every=cfg.checkpoint.every, last=cfg.train.steps))]
        try:
            state, stopped_at = run_steps(b.source, b.learner, state, range(first, cfg.train.steps + 1), hooks)
            signals.stage = "finish"
            if stopped_at is None and any_host(not self.evals):  # resumed after the last step, on a host without the logs
                self.evals.append((cfg.train.steps, self._evaluate(cfg.train.steps)))
        finally:
            session.close_progress()
            if self.writer is not None:
                self.writer.close()
            session.sync()  # what there is, even when the run stops with an error
        self.state = state  # the final train state (placed), for callers that inspect it
        if stopped_at is not None or signals.failure:  # user code that failed at the last step stops it too
            return session.stopped(stopped_at or cfg.train.steps, steps=cfg.train.steps)
        checkpointer.wait()  # the last checkpoint committed before the summary says the run is done
        return self._summary(b.learner.footprint(state))

    # --- hooks ------------------------------------------------------------------------------------
    def _evaluate_hook(self, info: StepInfo) -> None:
        if self.signals.stopping:  # the run stops after this step: at once, not evaluating (its calls of
            return                 # user code would be given up on, and their episodes scored as wrong)
        self.evals.append((info.step, self._evaluate(info.step)))
        info.metrics.update(self.evals[-1][1])

    def _write_metrics(self, info: StepInfo) -> None:
        self.rewards.append(info.metrics["reward/mean"])
        if self.writer is not None:
            self.writer.write(info.step, info.metrics)
            self.writer.write_histogram(info.step, "health/pass_rate", info.batch.log.pass_rates,
                                        bins=info.batch.group_size + 1, value_range=(0.0, 1.0))

    def _write_samples(self, info: StepInfo) -> None:
        if self.writer is not None:  # process 0's rows: the batch's first
            t = info.batch
            self.writer.write_samples(info.step, t.log.samples(self.config.train.samples_count, t.group_size))

    def _tell(self, info: StepInfo, bar: ProgressBar) -> None:
        """The caller's metric hooks (`train(hooks=...)`) and the progress bar."""
        for hook in self.hooks:
            hook(info.step, info.metrics)
        bar.update(info.step, info.metrics)

    # --- around the loop --------------------------------------------------------------------------
    def _evaluate(self, step: int) -> dict:
        ev = evaluate_run(self.built.source.model, self.prepared.eval, teacher=self.built.teacher)  # as `grpo-jax eval`
        self.log(f"eval at step {step}: accuracy {ev['eval/accuracy']:.3f}, pass@{self.config.eval.k} "
                 f"{ev['eval/pass@k']:.3f}")
        return ev

    def _past_evals(self, resume_from: int | None) -> list[tuple[int, dict]]:
        """A resumed run's evaluations so far, from its metrics.jsonl (pulled from remote storage)."""
        if resume_from is None or not self.primary:
            return []
        self.storage.pull()  # a remote run resumed on a fresh machine: its logs so far
        if not (self.run_dir / "metrics.jsonl").exists():
            return []
        return [(r["step"], r) for r in read_metrics(self.run_dir) if "eval/accuracy" in r and r["step"] <= resume_from]

    def _summary(self, learner_bytes: dict) -> RunResult:
        plot = plot_run(self.run_dir) if self.primary else None
        self.session.sync()
        start, end = self.evals[0][1], self.evals[-1][1]
        self.log(f"eval accuracy {start['eval/accuracy']:.3f} -> {end['eval/accuracy']:.3f}; "
                 f"metrics: {self.run_dir / 'metrics.jsonl'}; plot: {plot}")
        return RunResult(run_dir=str(self.storage), step=self.config.train.steps, eval_start=start, eval_end=end,
                         reward=tuple(self.rewards), plot=str(plot) if plot else None, learner_bytes=learner_bytes)


def train(config: RunConfig, run_dir: str | Path, *, hooks: Sequence[MetricHook] = (),
          log: Callable[[str], None] | None = None) -> RunResult:
    """Run GRPO as configured; returns its RunResult: the start and end evaluations and the
    per-step mean rewards, or, when a stop signal ended it, the step whose checkpoint is complete."""
    return Trainer(config, run_dir, hooks=hooks, log=log).run()
