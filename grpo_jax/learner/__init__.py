"""The learner side: the objectives (GRPO, PPO, distillation, log-probs; one per `algorithm`), the
one update and step factory every training step is built from (`step_factory`), the RL train step
(`step(state, batch)` over a `StepSpec` bound once), the optimizer builder, the `Learner` the loop
updates (jit on a mesh; the pmap mode in `pmap`) and the `StepSource` interface the loop feeds it
from. Exported here: what the trainer, the tools and the actor side use."""

from grpo_jax.learner.feed import StepSource
from grpo_jax.learner.learner import Learner, MeshLearner
from grpo_jax.learner.modes import make_learner
from grpo_jax.learner.logprobs import chunked_logprobs, completion_logprobs
from grpo_jax.learner.objectives import make_objective
from grpo_jax.learner.optimizer import make_optimizer, run_optimizer, warm_start_optimizer
from grpo_jax.learner.step_factory import TrainState, check_skips, make_step, new_state
from grpo_jax.learner.train_step import Batch, StepSpec, init_state, merge_model, split_trainable

__all__ = ["Batch", "Learner", "MeshLearner", "StepSource", "StepSpec", "TrainState", "check_skips",
           "chunked_logprobs", "completion_logprobs", "init_state", "make_learner", "make_objective",
           "make_optimizer", "make_step", "merge_model", "new_state", "run_optimizer", "split_trainable",
           "warm_start_optimizer"]
