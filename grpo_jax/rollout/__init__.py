"""The actor side above the engine: the rollout sources the loop pulls each step's trajectories
from (`source`: the `RolloutSource` interface and the synchronous sampler; `episode_source`:
multi-turn episodes; `pipeline`: sampling ahead of the learner on its own devices), collection with
DAPO's dynamic sampling (`collect`, `stream`), held-out evaluation (`evaluation`) and the rollouts'
health metrics (`health`). Sampling itself is grpo_jax.engine; episodes, grpo_jax.episodes."""
