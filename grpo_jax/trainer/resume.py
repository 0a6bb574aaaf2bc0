"""Resuming a run: which checkpoint to continue from, checked before anything is written
(`check_resumable`, `resumable_steps`), and the state, KL reference, prompt stream and reward
states restored from it (`resume`, `restore_state`), as `checkpoint.save_step` wrote them. Both follow
`checkpoint.first_restorable` (newest first, damaged steps warned about and skipped), decided by
all hosts together so every host resumes the same step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


from grpo_jax.config import ConfigError, RunConfig
from grpo_jax.learner.step_factory import TrainState
from grpo_jax.rewards import RewardStates
from grpo_jax.rollout.source import RolloutSource
from grpo_jax.runtime.hosts import any_host
from grpo_jax.trainer import lora_base
from grpo_jax.trainer.checkpoint import Checkpointer, NothingRestores, first_restorable
from grpo_jax.trainer.run_state import CheckpointMeta, load_components


def check_base(config: RunConfig, meta: CheckpointMeta, run_dir: Path, where: str) -> None:
    """A LoRA run resumes only LoRA checkpoints of the same base (fingerprint), a full fine-tune
    only full ones: a ConfigError otherwise."""
    saved = meta.base
    if config.lora.enabled != (saved is not None):
        kinds = ("LoRA adapters", "full parameters")
        have, want = kinds[saved is None], kinds[not config.lora.enabled]
        raise ConfigError(f"{where} holds checkpoints of {have}, this config trains {want} (lora.rank="
                          f"{config.lora.rank}); resume it with its own config or choose another --output")
    if saved is not None:
        lora_base.locate(saved, run_dir)


def resumable_steps(checkpointer: Checkpointer, steps: list[int], *, prepared, run_dir: Path, model_json: dict,
                    where: str, warn: Callable[[str], None]) -> list[int]:
    """The saved steps to resume from, newest first, starting at the newest whose metadata
    restores; every reason to refuse the restart (another model, data layout, seed, host count, LoRA
    base: a ConfigError) is found here, before the run directory is written."""
    def check(step: int) -> None:
        check_resumable(checkpointer, step, stream=prepared.rollout.stream, run_dir=run_dir, model_json=model_json)
        meta = checkpointer.restore_meta(step)
        check_base(prepared.config, meta, run_dir, where)
        if meta.pipeline and not prepared.config.rollout.pipelined:
            raise ConfigError(f"{where}: checkpoint step {step} is of a run with rollout.staleness > 0 (it holds "
                              "batches in flight); resume it with its rollout settings")

    try:
        step, _, _ = first_restorable(steps, check, where=where, warn=warn, agree=any_host)
    except NothingRestores as e:
        raise ConfigError(str(e)) from None
    return steps[steps.index(step):]


def restore_state(checkpointer: Checkpointer, candidates: list[int], state, *, learner, prepared, where: str,
                  warn: Callable[[str], None], source=None) -> tuple[Any, int]:
    """(state, step) from the newest candidate that restores completely, with the learner's KL
    reference, the prompt stream and the rewards' states; damaged newer steps are set aside
    (`Checkpointer.set_aside`) so the resumed run can save those steps again."""
    def attempt(step: int):
        return resume(checkpointer, step, state, stream=prepared.rollout.stream, reference=learner.reference,
                      rewards=prepared.rollout.rewards, source=source)

    skipped = [s for s in checkpointer.all_steps() if s > candidates[0]]  # found damaged by `resumable_steps`
    try:
        step, (restored, reference), failed = first_restorable(candidates, attempt, where=where, warn=warn,
                                                               agree=any_host)
    except NothingRestores as e:
        raise ConfigError(str(e)) from None
    damaged = skipped + failed
    if damaged:
        checkpointer.set_aside(damaged)
        warn(f"set aside the damaged checkpoints of steps {sorted(damaged)} (checkpoints_damaged/)")
    learner.reference = reference
    return restored, step


def check_resumable(checkpointer: Checkpointer, step: int, *, stream, run_dir: Path, model_json: dict) -> None:
    """Everything that would stop `resume` from continuing checkpoint `step`, checked before a
    restarted run writes anything: the run's architecture (`run_dir/model/config.json`) against the
    config's (`model_json`, what `write_model_files` would write), the number of hosts, and this
    host's prompt stream against the saved one (loaded into `stream`, as `resume` does again). A
    ConfigError says what differs."""
    saved_file = Path(run_dir) / "model" / "config.json"
    if saved_file.exists():
        saved = json.loads(saved_file.read_text())
        ignore = {"torch_dtype", "dtype", "transformers_version"}
        changed = sorted(k for k in set(saved) | set(model_json) if k not in ignore and saved.get(k) != model_json.get(k))
        if changed:
            diff = ", ".join(f"{k} {saved.get(k)!r} -> {model_json.get(k)!r}" for k in changed[:6])
            raise ConfigError(f"{run_dir} holds a run of another model ({diff}); resume it with its own config "
                              f"({Path(run_dir) / 'config.yaml'}) or choose another --output")
    load_components(checkpointer.restore_meta(step), {"data": stream}, required=("data",))


def resume(checkpointer: Checkpointer, step: int, state: TrainState, *, stream, reference=None,
           rewards: Sequence = (), source: RolloutSource | None = None):
    """(state, reference) of checkpoint `step`, placed like `state` and `reference`, with this
    host's prompt stream moved to where it was and its rewards' states restored (the components
    `save_step` wrote), and a pipelined `source` given its batches in flight. A checkpoint of
    another number of hosts, or a stream with other settings, is a ConfigError."""
    # A pipelined run's batches in flight (a synchronous run never gets here with them: resumable_steps).
    flight = checkpointer.restore_meta(step).pipeline if source is not None else None
    like = source.in_flight_like(len(flight["steps"])) if flight else None
    restored, saved_reference, meta, in_flight = checkpointer.restore(step, state, reference, in_flight=like)
    if flight:
        source.restore(flight, in_flight)
    load_components(meta, {"data": stream, "rewards": RewardStates(rewards)}, required=("data",))
    return restored, (reference if saved_reference is None else saved_reference)
