"""What the rollout side reads, declared here (not reached for in the trainer's objects): the
frozen inputs of a rollout source (`RolloutInputs`) and of held-out evaluation (`EvalInputs`),
and the two protocols they hold: the tokenizer's few methods the actor side calls (`Tokenizer`),
and a run's environment episodes (`EpisodeRunner`: grpo_jax.episodes.runner's). The trainer's
`prepare` builds them from a config (the trainer's own inputs are a composition of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
from jax.sharding import Mesh

from grpo_jax.config import SamplingConfig
from grpo_jax.data.stream import PromptStream
from grpo_jax.rewards import RewardSpec
from grpo_jax.rollout.retention import Retention
from grpo_jax.runtime.hosts import RowShare


@runtime_checkable
class Tokenizer(Protocol):
    """A transformers tokenizer, or grpo_jax.data's char tokenizer: what a run calls of it."""

    pad_token_id: int | None
    eos_token_id: int | None

    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str: ...

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kwargs: Any) -> list[str]: ...

    def apply_chat_template(self, conversation: Sequence[dict], **kwargs: Any) -> Any: ...

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> Any: ...


class EpisodeRunner(Protocol):
    """A run's environment: `run` plays `sampling.group_size` episodes of each example to their end
    with `model` and returns them (a grpo_jax.episodes.runner.EpisodeBatch); `padding`: the last
    examples only fill the batch's shape."""

    def run(self, model, examples: Sequence, sampling: SamplingConfig, rng: jax.Array, padding: int = 0) -> Any: ...


@dataclasses.dataclass(frozen=True)
class RolloutInputs:
    """A rollout source's inputs: this host's share of each step's prompts (`stream`, `share`), the
    rewards (`correct_by`: the one whose pass rate the health metrics report, evaluation's judge),
    the tokenizer, the sampling settings (stop and pad ids resolved), where it samples
    (`sampler_mesh`, rollout.sampler_devices' own mesh, else the learner's `mesh`) and, with an
    environment, its episodes."""

    stream: PromptStream
    rewards: tuple[RewardSpec, ...]
    correct_by: str
    tokenizer: Tokenizer
    sampling: SamplingConfig
    mesh: Mesh
    share: RowShare
    sampler_mesh: Mesh | None = None
    episodes: EpisodeRunner | None = None

    @property
    def sample_mesh(self) -> Mesh:
        return self.sampler_mesh or self.mesh


@dataclasses.dataclass(frozen=True)
class EvalInputs:
    """What the held-out evaluation reads (grpo_jax.rollout.evaluation.evaluate_run): the prompts,
    how they are sampled and judged, where (`mesh`: where the run samples), the episodes of a run
    with an environment, the retention probe, and the seed its rng comes from."""

    sampling: SamplingConfig  # the run's sampling with eval.k samples per prompt at eval.temperature
    reward: RewardSpec  # what correctness is judged by: eval.reward, else the first training reward
    verifier: RewardSpec | None  # eval.verifier: a second judge of the held-out samples
    examples: tuple  # the first eval.num_prompts usable rows of the eval split, each once (every host has all)
    tokenizer: Tokenizer
    mesh: Mesh
    seed: int  # the evaluation's rng: key(seed), the same completions for the same parameters
    episodes: EpisodeRunner | None = None
    retention: Retention | None = None  # eval.retention: the general corpus's probe (its reference set by the run)

    def judges(self) -> list[RewardSpec]:
        return [self.reward, *([self.verifier] if self.verifier is not None else [])]
