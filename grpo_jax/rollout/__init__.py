"""The actor side above the engine: the rollout sources the loop pulls each step's trajectories
from (`source`: the `RolloutSource` interface and the synchronous sampler; `episode_source`:
multi-turn episodes; `pipeline`: sampling ahead of the learner on its own devices), collection with
DAPO's dynamic sampling (`collect`, `stream`), held-out evaluation (`evaluation`) and the rollouts'
health metrics (`health`). Sampling itself is grpo_jax.engine; episodes, grpo_jax.episodes.
Exported here: what the trainer and the tools use."""

from grpo_jax.rollout.episode_source import EpisodeSampler
from grpo_jax.rollout.evaluation import evaluate_run, prompts_per_call
from grpo_jax.rollout.inputs import EpisodeRunner, EvalInputs, RolloutInputs, Tokenizer
from grpo_jax.rollout.pipeline import PipelinedSource
from grpo_jax.rollout.source import InFlight, RolloutSource, SampleLog, SyncSampler, TrainRows, Trajectories

__all__ = ["EpisodeSampler", "InFlight", "PipelinedSource", "RolloutSource", "SampleLog", "SyncSampler", "TrainRows",
           "Trajectories", "evaluate_run", "prompts_per_call",
           "EpisodeRunner", "EvalInputs", "RolloutInputs", "Tokenizer"]
