"""A training run: its inputs prepared and checked (`prepare`), its pieces built (`setup`), the loop
and its hooks (`loop`, `hooks`), checkpoints and resume (`checkpoint`, `resume`), stop signals
(`preemption`) and the supervised warm start. The reward-model trainer (grpo_jax.tools.reward_run)
runs in the same loop. Exported here: what the tools and the CLI use."""

from grpo_jax.trainer.checkpoint import (Checkpointer, NothingRestores, find_run, first_restorable, load_policy,
                                         local_base)
from grpo_jax.trainer.hooks import Hook, StepInfo
from grpo_jax.trainer.loop import Trainer, run_steps, train
from grpo_jax.trainer.preemption import StopSignals, stop_report
from grpo_jax.trainer.prepare import Prepared, prepare

__all__ = ["Checkpointer", "Hook", "NothingRestores", "Prepared", "StepInfo", "StopSignals", "Trainer", "find_run",
           "first_restorable", "load_policy", "local_base", "prepare", "run_steps", "stop_report", "train"]
