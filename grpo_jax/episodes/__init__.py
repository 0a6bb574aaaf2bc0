"""Multi-turn episodes over the paged engine's slots: one episode on the host
(`episode`: its environment's calls on their own threads, its limits), its messages as tokens that
extend the trajectory (`transcript`), the engine programs that pause a slot at a turn's end and
feed the environment's answer, with preemption and replay on a page pool (`turns`), where a parked
episode's cache waits (`parking`), the
host's side between segments (`host`) and the driver that runs
a batch of episodes (`runner`). The environments themselves live in grpo_jax.env."""

from grpo_jax.episodes.episode import EpisodeLimits
from grpo_jax.episodes.runner import EpisodeRunner

__all__ = ["EpisodeLimits", "EpisodeRunner"]
