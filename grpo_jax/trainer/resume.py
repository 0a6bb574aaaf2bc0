"""Resuming a run: which checkpoint to continue from, checked before anything is written, and the
state, KL reference, prompt stream and reward states restored from it. Both follow
`checkpoint.first_restorable` (newest first, damaged steps warned about and skipped), decided by
all hosts together so every host resumes the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_jax.config import ConfigError, RunConfig
from grpo_jax.runtime.hosts import any_host
from grpo_jax.trainer import lora_base
from grpo_jax.trainer.checkpoint import Checkpointer, NothingRestores, check_resumable, first_restorable, resume


def check_base(config: RunConfig, meta: dict, run_dir: Path, where: str) -> None:
    """A LoRA run resumes only LoRA checkpoints of the same base (fingerprint), a full fine-tune
    only full ones: a ConfigError otherwise."""
    saved = meta.get("base")
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
        check_resumable(checkpointer, step, stream=prepared.train_stream, run_dir=run_dir, model_json=model_json)
        meta = checkpointer.restore_meta(step)
        check_base(prepared.config, meta, run_dir, where)
        if meta.get("pipeline") and not prepared.config.rollout.pipelined:
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
        return resume(checkpointer, step, state, stream=prepared.train_stream, reference=learner.reference,
                      rewards=prepared.rewards, source=source)

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
