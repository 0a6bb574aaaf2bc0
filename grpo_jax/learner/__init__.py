"""The learner side: the objectives (GRPO, PPO, distillation, log-probs), the one update and step
factory every training step is built from (`step_factory`), the RL train step, the optimizer
builder, the jit/pmap parallelism, the `Learner` the loop updates and the `StepSource` interface
the loop feeds it from. Exported here: what the trainer, the tools and the actor side use."""

from grpo_jax.learner.feed import StepSource
from grpo_jax.learner.learner import Learner
from grpo_jax.learner.logprobs import chunked_logprobs, completion_logprobs
from grpo_jax.learner.optimizer import make_optimizer, run_optimizer, warm_start_optimizer
from grpo_jax.learner.parallel import Parallel, make_parallel
from grpo_jax.learner.step_factory import TrainState, check_skips, make_step, new_state
from grpo_jax.learner.train_step import Batch, init_state, merge_model, split_trainable

__all__ = ["Batch", "Learner", "Parallel", "StepSource", "TrainState", "check_skips", "chunked_logprobs",
           "completion_logprobs", "init_state", "make_optimizer", "make_parallel", "make_step", "merge_model",
           "new_state", "run_optimizer", "split_trainable", "warm_start_optimizer"]
