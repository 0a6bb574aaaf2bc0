"""A training run: its inputs prepared and checked (`prepare`), its pieces built (`setup`), the loop
and its hooks (`loop`, `hooks`), checkpoints and resume (`checkpoint`, `resume`), stop signals
(`preemption`), the supervised warm start, and one run lifecycle (`session`: lock, run directory,
config.yaml, logs, progress bar, signals, checkpoint hook) with its typed state (`run_state`:
CheckpointMeta, RunResult). The reward-model trainer (`reward_run`, over `reward_pairs`) runs in the
same loop and session; `check` checks a config's inputs. Exported here: what the tools and the CLI use,
loaded on first use, so `grpo_jax.trainer.check` (the CLI's parser reads its commands) starts no JAX."""

import importlib

_EXPORTS = {
    **dict.fromkeys(("Checkpointer", "NothingRestores", "find_run", "first_restorable", "load_policy", "local_base"),
                    "grpo_jax.trainer.checkpoint"),
    **dict.fromkeys(("Hook", "StepInfo"), "grpo_jax.trainer.hooks"),
    **dict.fromkeys(("Trainer", "run_steps", "train"), "grpo_jax.trainer.loop"),
    **dict.fromkeys(("StopSignals", "stop_report"), "grpo_jax.trainer.preemption"),
    **dict.fromkeys(("Prepared", "prepare"), "grpo_jax.trainer.prepare"),
    **dict.fromkeys(("CheckpointMeta", "RunResult"), "grpo_jax.trainer.run_state"),
    "RunSession": "grpo_jax.trainer.session",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpo_jax.trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
