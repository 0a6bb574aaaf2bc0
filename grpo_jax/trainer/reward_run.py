"""`grpo-jax train-rm`'s run: the reward model trains in the RL trainer's loop
(grpo_jax.trainer.loop.run_steps) with its hooks, checkpoints and stop signals, not a loop of its
own. The source is the stream of training pairs (`PairSource`), the learner the step factory's
Bradley-Terry step (`PairLearner`); held-out pair accuracy, metrics.jsonl, the progress bar and
orbax checkpoints (`OUTPUT/checkpoints/<step>`: the train state and the pair stream's position)
are hooks. `train.resume: true` continues from the newest checkpoint that restores, and equals the
uninterrupted run. The pairs: grpo_jax.tools.reward_training; the model: grpo_jax.models.build; the
loss and steps: grpo_jax.learner.bradley_terry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import yaml
from flax import nnx

from grpo_jax.config import ConfigError, RMRunConfig
from grpo_jax.config.loading import config_to_dict
from grpo_jax.learner.bradley_terry import make_steps
from grpo_jax.learner.feed import StepSource
from grpo_jax.learner.optimizer import make_optimizer
from grpo_jax.learner.step_factory import TrainState, check_skips, new_state
from grpo_jax.models.build import build_reward_model, build_tokenizer
from grpo_jax.models.reward_model import save_reward_model
from grpo_jax.observe import MetricsWriter, ProgressBar
from grpo_jax.runtime.sharding import make_mesh, mesh_devices, on_mesh, round_to_row_shards
from grpo_jax.tools.reward_training import Pairs, encode_pairs, evaluate_pairs, read_rows
from grpo_jax.runtime.run_lock import RunLock
from grpo_jax.trainer.checkpoint import Checkpointer, NothingRestores, first_restorable
from grpo_jax.trainer.hooks import Hook, StepInfo
from grpo_jax.trainer.loop import run_steps
from grpo_jax.trainer.preemption import StopSignals, stop_report


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
        return state, meta

    try:
        step, (state, meta), _ = first_restorable(steps, attempt, where=str(checkpointer.directory), warn=log)
    except NothingRestores as e:
        raise ConfigError(str(e)) from None
    source.load_state_dict(meta["pairs"])
    return state, step


def train_reward_model(config: RMRunConfig, output: str | Path, *, log: Callable[[str], None] = print) -> dict:
    """Train (see the module docstring); returns the last evaluation's metrics (or, when a stop
    signal ended the run, where to resume it)."""
    out, t = Path(output), config.train
    # The stop signals' handlers stay until the last checkpoint is closed and the lock released.
    with StopSignals(log, every_minutes=config.checkpoint.every_minutes) as signals, RunLock(out, log=log), \
            Checkpointer(out / "checkpoints", keep=config.checkpoint.keep, log=log) as checkpointer:
        saved = checkpointer.all_steps()
        if saved and not t.resume:
            raise ConfigError(f"{out} already holds checkpoints (newest: step {saved[0]}); resume it "
                              "(train.resume: true) or choose another --output")
        out.mkdir(parents=True, exist_ok=True)
        if not saved:  # a resumed run keeps the config.yaml it started with
            (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
        return _train(checkpointer, saved, build_run(config, out, log), signals, log)


def _train(checkpointer: Checkpointer, saved: list[int], run: RMRun, signals: StopSignals, log) -> dict:
    t, every = run.config.train, run.config.checkpoint.every
    source = PairSource(run.train, run.batch, t.seed)
    state, resumed = restore(checkpointer, saved, run, source, log) if saved else (run.state, None)
    last = {"eval": evaluate_pairs(run.score, state.params, run.held, run.batch)}
    log(f"eval at step {resumed or 0}: pair accuracy {last['eval']['rm/pair_accuracy']:.3f}")

    def evaluate(info: StepInfo) -> None:
        last["eval"] = evaluate_pairs(run.score, info.state.params, run.held, run.batch)
        info.metrics.update(last["eval"])
        bar.write(f"eval at step {info.step}: pair accuracy {last['eval']['rm/pair_accuracy']:.3f}")

    def save(info: StepInfo) -> bool:
        checkpointer.check()  # a save that failed since: CheckpointError, one line
        stop, due = signals.check(info.step)
        if stop or due or every and info.step % every == 0 or info.last:
            checkpointer.save(info.step, info.state, {"step": info.step, "seed": t.seed, "pairs": source.state_dict()})
            signals.saved()
        return stop

    with MetricsWriter(run.out) as writer, ProgressBar(
            t.steps, enabled=t.progress, initial=resumed or 0, start=last["eval"],
            fields=(("loss", ("rm/loss",), False), ("acc", ("rm/accuracy",), False),
                    ("held-out pairs", ("rm/pair_accuracy",), True))) as bar:
        if resumed is None:
            writer.write(0, last["eval"])
        else:
            writer.truncate_after(resumed)  # what the interrupted run wrote after its last checkpoint
        hooks = [Hook(evaluate, every=t.eval_every, at_last=True), Hook(lambda i: writer.write(i.step, i.metrics)),
                 Hook(lambda i: bar.update(i.step, {**i.metrics, **last["eval"]})),
                 Hook(save)]
        learner = PairLearner(run.train_step, max_consecutive_skips=t.max_consecutive_skips)
        state, stopped_at = run_steps(source, learner, state, range((resumed or 0) + 1, t.steps + 1), hooks)
    checkpointer.wait()
    if stopped_at is not None:
        return stop_report(signals.received, step=stopped_at, steps=t.steps, where=str(run.out), resuming=False,
                           log=log)
    nnx.update(run.model, state.params)
    save_reward_model(run.model, run.out / "hf", tokenizer=run.tokenizer)
    log(f"train-rm: held-out pair accuracy {last['eval']['rm/pair_accuracy']:.3f}; saved the reward model to "
        f"{run.out / 'hf'}")
    return last["eval"]
