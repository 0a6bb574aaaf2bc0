"""A training run: its inputs prepared and checked (`prepare`), its pieces built (`setup`), the loop
and its hooks (`loop`, `hooks`), checkpoints and resume (`checkpoint`, `resume`), stop signals
(`preemption`), the supervised warm start, and one run lifecycle (`session`: lock, run directory,
config.yaml, logs, progress bar, signals, checkpoint hook) with its typed state (`run_state`:
CheckpointMeta, RunResult). The reward-model trainer (`reward_run`, over `reward_pairs`) runs in the
same loop and session; `check` checks a config's inputs. Exported here: what the tools and the CLI use."""

from grpo_jax.trainer.checkpoint import (Checkpointer, NothingRestores, find_run, first_restorable, load_policy,
                                         local_base)
from grpo_jax.trainer.hooks import Hook, StepInfo
from grpo_jax.trainer.loop import Trainer, run_steps, train
from grpo_jax.trainer.preemption import StopSignals, stop_report
from grpo_jax.trainer.prepare import Prepared, prepare
from grpo_jax.trainer.run_state import CheckpointMeta, RunResult
from grpo_jax.trainer.session import RunSession

__all__ = ["CheckpointMeta", "Checkpointer", "Hook", "NothingRestores", "Prepared", "RunResult", "RunSession",
           "StepInfo", "StopSignals", "Trainer", "find_run",
           "first_restorable", "load_policy", "local_base", "prepare", "run_steps", "stop_report", "train"]
