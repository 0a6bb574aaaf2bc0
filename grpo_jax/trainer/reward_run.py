"""`grpo-jax train-rm`'s run: the reward model trains in the RL trainer's loop
(grpo_jax.trainer.loop.run_steps) with its hooks, checkpoints and stop signals, not a loop of its
own. The source is the stream of training pairs (`PairSource`), the learner the step factory's
Bradley-Terry step (`PairLearner`); held-out pair accuracy, metrics.jsonl, the progress bar and
orbax checkpoints (`OUTPUT/checkpoints/<step>`: the train state and the pair stream's position)
are hooks. `train.resume: true` continues from the newest checkpoint that restores, and equals the
uninterrupted run. The pairs: grpo_jax.trainer.reward_pairs; the model: grpo_jax.models.build; the
loss and steps: grpo_jax.learner.bradley_terry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from grpo_jax.config import ConfigError, RMRunConfig
from grpo_jax.learner.bradley_terry import make_steps
from grpo_jax.learner.feed import StepSource
from grpo_jax.learner.optimizer import make_optimizer
from grpo_jax.learner.step_factory import TrainState, check_skips, new_state
from grpo_jax.models.build import build_reward_model, build_tokenizer
from grpo_jax.models.reward_model import save_reward_model
from grpo_jax.runtime.sharding import make_mesh, mesh_devices, on_mesh, round_to_row_shards
from grpo_jax.trainer.checkpoint import Checkpointer, NothingRestores, first_restorable
from grpo_jax.trainer.hooks import Hook, StepInfo
from grpo_jax.trainer.loop import run_steps
from grpo_jax.trainer.preemption import StoppedBeforeStart
from grpo_jax.trainer.reward_pairs import Pairs, encode_pairs, evaluate_pairs, read_rows
from grpo_jax.trainer.run_state import CheckpointMeta, RunResult, load_components, save_components
from grpo_jax.trainer.session import RunSession


@dataclasses.dataclass
class PairBatch:
    rows: tuple  # (ids, mask int32 [B, 2, T], margin float32 [B], answer_start int32 [B]), as `Pairs`
    metrics: dict = dataclasses.field(default_factory=dict)  # nothing measured before the update


class PairSource(StepSource):
    """`batch` training pairs a step in a seeded order. Every batch has `batch` pairs (one compiled
    shape), even from fewer pairs than that: an epoch's order wraps around, then the next order is
    drawn from the same generator. Its position (`state_dict`) goes into every checkpoint."""

    def __init__(self, pairs: Pairs, batch: int, seed: int):
        self.pairs, self.batch, self.seed = pairs, batch, seed
        self.load_state_dict({"orders": 1, "cursor": 0})

    def next(self, step: int) -> PairBatch:
        idx = np.take(self.order, np.arange(self.cursor, self.cursor + self.batch), mode="wrap")
        self.cursor += self.batch
        if self.cursor >= len(self.order):
            self.order, self.cursor, self.orders = self.rng.permutation(len(self.pairs.margin)), 0, self.orders + 1
        p = self.pairs
        return PairBatch(rows=(p.ids[idx], p.mask[idx], p.margin[idx], p.answer_start[idx]))

    def sync(self, params) -> None:
        """Nothing samples from the reward model while it trains."""

    def state_dict(self) -> dict:
        return {"orders": self.orders, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Back to a saved position: the generator replays the orders drawn so far."""
        self.rng = np.random.default_rng(self.seed)
        for _ in range(state["orders"]):
            self.order = self.rng.permutation(len(self.pairs.margin))
        self.orders, self.cursor = state["orders"], state["cursor"]


class PairLearner:
    """The loop's learner for a reward model: the step factory's step on a batch of pairs."""

    def __init__(self, step, *, max_consecutive_skips: int):
        self.step, self.max_consecutive_skips = step, max_consecutive_skips

    def update(self, state: TrainState, batch: PairBatch, while_waiting=None) -> tuple[TrainState, dict]:
        state, metrics = self.step(state, batch.rows)
        while_waiting()
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        check_skips(metrics, self.max_consecutive_skips)
        return state, metrics

    def params(self, state: TrainState):
        return state.params


@dataclasses.dataclass
class RMRun:
    """A reward-model run's pieces, built before its first step."""

    config: RMRunConfig
    out: Path
    tokenizer: object
    model: object
    train: Pairs
    held: Pairs
    batch: int
    state: TrainState
    train_step: Callable
    score: Callable


def build_run(config: RMRunConfig, out: Path, log: Callable[[str], None]) -> RMRun:
    """The tokenizer, the pairs (with their counts logged), the mesh, the model and its steps."""
    t = config.train
    tokenizer = build_tokenizer(config.model)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has neither a pad nor an eos token: a reward model needs one to pad rows")
    train, train_stats = encode_pairs(read_rows(config, "train"), config, tokenizer)
    held, held_stats = encode_pairs(read_rows(config, "eval"), config, tokenizer, limit=config.data.eval_pairs)
    for what, stats in (("train", train_stats), ("held-out", held_stats)):
        log(f"train-rm: {stats['pairs']} {what} pairs, {stats['skipped']} rows skipped, {stats['truncated']} "
            f"truncated to data.max_length={config.data.max_length}"
            + (f" (first skip: {stats['first_skip']})" if stats["skipped"] else ""))
    if not train_stats["pairs"] or not held_stats["pairs"]:
        raise ConfigError("train-rm: no usable preference pairs in the train or held-out data (see the counts above)")
    try:
        mesh = make_mesh(config.mesh, mesh_devices(config.mesh))
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None
    batch = round_to_row_shards(t.batch_size, mesh)
    if batch != t.batch_size:
        log(f"train-rm: train.batch_size {t.batch_size} -> {batch} pairs, a multiple of the mesh's row shards")
    model = build_reward_model(config, tokenizer, mesh)
    optimizer = make_optimizer(t.optimizer)
    graphdef, params = nnx.split(model)
    state = on_mesh(new_state(params, optimizer), mesh)  # Adam's moments take the placed params' shardings
    train_step, score = make_steps(graphdef, optimizer, mesh, state, lm_coef=t.lm_coef)
    return RMRun(config=config, out=out, tokenizer=tokenizer, model=model, train=train, held=held, batch=batch,
                 state=state, train_step=train_step, score=score)


def restore(checkpointer: Checkpointer, steps: list[int], run: RMRun, source: PairSource, log) -> tuple:
    """(state, step) of the newest checkpoint that restores, with the pair stream where it was."""
    def attempt(step: int):
        state, _, meta, _ = checkpointer.restore(step, run.state)
        load_components(meta, {"pairs": source}, required=("pairs",))
        return state

    try:
        step, state, _ = first_restorable(steps, attempt, where=str(checkpointer.directory), warn=log)
    except NothingRestores as e:
        raise ConfigError(str(e)) from None
    return state, step


def train_reward_model(config: RMRunConfig, output: str | Path, *, log: Callable[[str], None] | None = None
                       ) -> RunResult:
    """Train (see the module docstring); returns its RunResult (`eval_end`: the last evaluation's
    metrics), or, when a stop signal ended the run, where to resume it. The run's lifecycle (lock,
    run directory incl. gs://, config.yaml, logs, progress bar, stop signals) is the RL run's
    (grpo_jax.trainer.session)."""
    session = RunSession(output, checkpoint=config.checkpoint, resume=config.train.resume, log=log)
    with session:
        with session.claim() as checkpointer:
            saved = session.saved_steps()
            session.open(config, resuming=bool(saved))
            try:
                return _train(session, checkpointer, saved, build_run(config, session.run_dir, session.log))
            except StoppedBeforeStart:
                return session.stopped(None, steps=config.train.steps, resuming=bool(saved))


def _train(session: RunSession, checkpointer: Checkpointer, saved: list[int], run: RMRun) -> RunResult:
    t, log = run.config.train, session.log
    source = PairSource(run.train, run.batch, t.seed)
    state, resumed = restore(checkpointer, saved, run, source, log) if saved else (run.state, None)
    first = evaluate_pairs(run.score, state.params, run.held, run.batch)
    last = {"eval": first}
    log(f"eval at step {resumed or 0}: pair accuracy {first['rm/pair_accuracy']:.3f}")
    session.signals.stop_point()  # a signal during setup: nothing new to save
    session.signals.stage = "steps"

    def evaluate(info: StepInfo) -> None:
        last["eval"] = evaluate_pairs(run.score, info.state.params, run.held, run.batch)
        info.metrics.update(last["eval"])
        log(f"eval at step {info.step}: pair accuracy {last['eval']['rm/pair_accuracy']:.3f}")

    def save(info: StepInfo) -> None:
        meta = CheckpointMeta(step=info.step, seed=t.seed, components=save_components({"pairs": source}))
        checkpointer.save(info.step, info.state, meta)

    writer = session.metrics_writer(resumed)
    if writer is not None and resumed is None:
        writer.write(0, first)
    bar = session.progress(t.steps, enabled=t.progress, initial=resumed or 0, start=first,
                           fields=(("loss", ("rm/loss",), False), ("acc", ("rm/accuracy",), False),
                                   ("held-out pairs", ("rm/pair_accuracy",), True)))
    hooks = [Hook(evaluate, every=t.eval_every, at_last=True),
             Hook(lambda i: writer.write(i.step, i.metrics) if writer is not None else None),
             Hook(lambda i: bar.update(i.step, {**i.metrics, **last["eval"]})),
             Hook(session.checkpoint_hook(save, every=run.config.checkpoint.every, last=t.steps))]
    learner = PairLearner(run.train_step, max_consecutive_skips=t.max_consecutive_skips)
    try:
        state, stopped_at = run_steps(source, learner, state, range((resumed or 0) + 1, t.steps + 1), hooks)
        session.signals.stage = "finish"
    finally:
        session.close_progress()
        if writer is not None:
            writer.close()
        session.sync()
    if stopped_at is not None:
        return session.stopped(stopped_at, steps=t.steps)
    checkpointer.wait()
    if session.primary:
        nnx.update(run.model, state.params)
        save_reward_model(run.model, run.out / "hf", tokenizer=run.tokenizer)
        session.sync()
    log(f"train-rm: held-out pair accuracy {last['eval']['rm/pair_accuracy']:.3f}; saved the reward model to "
        f"{session.storage}/hf")
    return RunResult(run_dir=str(session.storage), step=t.steps, eval_start=first, eval_end=last["eval"])
