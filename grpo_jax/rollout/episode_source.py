"""Multi-turn episodes as a rollout source: the step's prompts each open G episodes with the run's
environment (grpo_jax.episodes.runner), and the finished trajectories are the batch.

Per episode: the trajectory after the prompt is the completion (model turns and environment
tokens in one sequence; `completion_mask` = the loss mask, 1 exactly on sampled tokens), the old
log-probs are the sampler's (0 on environment tokens), and the reward is the environment's rewards
plus the run's weighted `rewards` on the last model turn (the example's fields carry the
`transcript`: every turn's model text, environment text and reward). An episode whose environment
failed has a NaN reward: it is dropped from the loss and counted (`env/failed`, by reason
`env/failed/<reason>`); a step's failures are logged in one line (the count by reason, the first
error), and samples.jsonl gives a failed episode's error (`env_error`).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from grpo_jax.rewards import combine_rewards
from grpo_jax.rollout.collect import Collected, Round, collect, step_key
from grpo_jax.rollout.evaluation import repeat_fields
from grpo_jax.rollout.source import SyncSampler, Trajectories


class EpisodeSampler(SyncSampler):
    """A SyncSampler whose samples are episodes (`inputs.episodes`, one device). `log(line)`
    reports a step's first environment error."""

    def __init__(self, inputs, model, *, log=print, **kw):
        super().__init__(inputs, model, **kw)
        self.episodes, self.log = inputs.episodes, log
        self.batch = None

    def next(self, step: int) -> Trajectories:
        c: Collected = collect(lambda i: self._round(step, i), num_groups=self.share.size,
                               group_size=self.sampling.group_size)
        # The prompts as the episodes opened them (their environments' messages, through the template).
        return self._trajectories(c, self.batch.prompt_ids, self.batch.prompt_mask, self.batch.metrics())

    def _round(self, step: int, round_index: int) -> Round:
        examples = self.inputs.stream.next_batch(self.share.size)
        t0 = time.perf_counter()
        key = step_key(self.rng, step, round_index)
        self.batch = batch = self.episodes.run(self.model, examples, self.sampling, key)
        sample_s = time.perf_counter() - t0
        rows, failed = batch.rows(self.sampling.pad_id), batch.failed
        if failed.any():
            self.log(f"step {step}: {failure_line(batch.episodes)}")
        t1 = time.perf_counter()
        G, texts = self.sampling.group_size, batch.final_turns()
        fields = {**repeat_fields(examples, G), "completion_tokens": [ep.model_tokens for ep in batch.episodes],
                  "transcript": [ep.transcript for ep in batch.episodes]}
        result = combine_rewards(self.inputs.rewards, [ex.prompt_text for ex in examples for _ in range(G)], texts,
                                 fields)
        env_reward = np.array([ep.env_reward or 0.0 for ep in batch.episodes], np.float64)
        with np.errstate(over="ignore"):  # a total beyond float32 (the loss's) is dropped, as a reward's is
            total = np.where(failed, np.nan, result.total + env_reward).astype(np.float32)
        total[np.isinf(total)] = np.nan
        result = dataclasses.replace(result, total=total)
        # `lengths`: the model's tokens (what completion/* and health describe), not the trajectory's.
        rows = rows.replace(lengths=np.array([ep.model_tokens for ep in batch.episodes], np.int32))
        return Round(examples=examples, rows=rows, texts=texts, rewards=result,
                     sample_s=sample_s, reward_s=time.perf_counter() - t1,
                     turns=[ep.transcript for ep in batch.episodes], errors=[ep.error for ep in batch.episodes])


def failure_line(episodes) -> str:
    """One line on a batch's failed episodes: how many, by reason, and the first one's error."""
    failed = [ep for ep in episodes if ep.error is not None]
    by = ", ".join(f"{n} {why}" for why, n in collections.Counter(ep.failure for ep in failed).most_common())
    return f"the environment failed {len(failed)} of {len(episodes)} episodes (dropped; {by}): {failed[0].error}"
