"""The seam between the actor side and the learner: a rollout source hands the loop one step's
finished groups (`Trajectories`) on demand, and takes the learner's new parameters after each
update (`sync`).

`RolloutSource` is the interface (every method the loop calls, declared); `SyncSampler` is the
synchronous source: it samples this host's block of prompts with the learner's current parameters
on the learner's own mesh, scores them on the host, runs dynamic sampling (`collect`), and puts
the chosen groups on the mesh as global arrays with the rollout's metrics gathered over every
host. Multi-turn episodes (rollout.episode_source) and rollouts ahead of the learner on their own
devices (rollout.pipeline) are other sources behind the same interface.

Shapes (the glossary: grpo_jax.shapes): R rows = N prompts x G samples, P prompt bucket, M
completion tokens. Row i*G + j is sample j of prompt i.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time

import flax.struct
import jax
import numpy as np
from flax import nnx

from grpo_jax.learner.feed import Stateful, StepSource
from grpo_jax.rewards import RewardResult, RewardStates, combine_rewards
from grpo_jax.rollout.collect import Collected, Round, collect, reward_metrics, sample_records, step_key
from grpo_jax.rollout.evaluation import decode_completions, repeat_fields
from grpo_jax.rollout.health import distinct_answers, random_control, rollout_health
from grpo_jax.engine.draw import SampleRows, left_pad
from grpo_jax.engine.sampling import engine_metrics, generate_with_stats, pad_prompts
from grpo_jax.rollout.stream import EngineStream, stream_collect
from grpo_jax.runtime.hosts import (any_host, common_bucket, gather_rows, local_rows, max_over_hosts, sum_over_shares,
                                    to_global)
from grpo_jax.engine.engines import engine_of
from grpo_jax.rollout.inputs import RolloutInputs



@flax.struct.dataclass
class TrainRows:
    """What the loss reads of a step's finished groups: global arrays on the mesh, rows split over
    data x fsdp x expert (grpo_jax.learner.learner completes them into the train step's Batch)."""

    prompt_ids: jax.Array  # int32 [R, P], left-padded
    prompt_mask: jax.Array  # int32 [R, P]
    completion_ids: jax.Array  # int32 [R, M]
    completion_mask: jax.Array  # int32 [R, M]: the loss mask
    rewards: jax.Array  # float32 [R]; NaN = dropped (a failed reward, a filler group)
    truncated: jax.Array  # bool [R]
    old_logprobs: jax.Array  # float32 [R, M]: the behaviour policy's (the sampler's)
    # A mixture-of-experts policy (None for a dense one): the experts the sampler routed each token
    # to (engine.routing), [R, P, L, Kx] for the prompt (left-padded as prompt_ids) and [R, M, L, Kx]
    # for the completion: learner.train_step.Batch's prompt_experts and completion_experts.
    prompt_experts: jax.Array | None = None
    completion_experts: jax.Array | None = None


@dataclasses.dataclass
class SampleLog:
    """What the logs read of a step: this host's first sampling round (samples.jsonl, reward
    failure messages) and the per-group pass rates (a histogram)."""

    first: Round
    pass_rates: np.ndarray  # float [N]

    def samples(self, count: int, group_size: int) -> list[dict]:
        """The first sample of each of this host's first `count` prompts, with its rewards."""
        return sample_records(self.first, group_size, count)


@dataclasses.dataclass
class Trajectories:
    """One step's finished groups, grouped by who reads them: `rows` the loss (global arrays on
    the mesh), `tokens` and `metrics` the step's metrics (the same on every host), `log` the logs."""

    rows: TrainRows
    group_size: int  # G
    tokens: int  # tokens an update reads (each prompt once per group when its pass is shared), all hosts
    metrics: dict[str, float]  # reward/*, groups/*, health/*, dynamic/*, data/*, perf/sample_*, perf/reward_s
    log: SampleLog


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A pipelined source's batches in flight when a checkpoint is taken: `meta` (JSON: their steps
    and the steps whose parameters sampled them), `params` (those parameters, one copy per batch)
    and `rewind` (the `data` and `rewards` components' states before the first of them: a
    resumed run samples them again)."""

    meta: dict
    params: list
    rewind: dict


def train_rows(c: Collected, prompt_ids: np.ndarray, prompt_mask: np.ndarray, group_size: int) -> TrainRows:
    """This host's rows of the loss from the collected groups and their prompts (ids and mask
    [N, P], one row per group, in the batch's bucket P), as NumPy: each prompt repeated for its G
    rows; a mixture-of-experts policy's prompt experts moved from the bucket their round sampled
    them in to P (left-padded, as the ids)."""
    G = group_size
    prompt_experts = c.rows.prompt_experts
    if prompt_experts is not None:
        prompt_experts = left_pad(prompt_experts, prompt_ids.shape[1])
    return TrainRows(prompt_ids=np.repeat(prompt_ids, G, axis=0), prompt_mask=np.repeat(prompt_mask, G, axis=0),
                     completion_ids=c.rows.tokens, completion_mask=c.rows.mask, rewards=c.rewards,
                     truncated=c.rows.truncated, old_logprobs=c.rows.logprobs, prompt_experts=prompt_experts,
                     completion_experts=c.rows.experts)


class RolloutSource(StepSource):
    """Where the RL loop's trajectories come from: every method the loop, the checkpoints and
    evaluation call on a source (the loop's own, `StepSource`'s, and what a checkpoint and the
    evaluation need). `next` and `sync` are each source's own; the rest default to a source that
    samples only when asked (nothing ahead of the learner, nothing in flight). `model`: the
    policy the sampler reads, which evaluation reads too."""

    model: nnx.Module

    @abc.abstractmethod
    def next(self, step: int) -> Trajectories:
        """The finished groups the update of `step` learns from."""

    @abc.abstractmethod
    def sync(self, params: nnx.State) -> None:
        """The learner's parameters after an update: what the next rollouts sample with."""

    def in_flight(self) -> InFlight | None:
        """The batches sampled ahead and not yet learned from, for a checkpoint taken now."""
        return None

    def in_flight_like(self, count: int) -> list:
        """Shapes and shardings of `count` parameter copies as the sampler holds them (restore targets)."""
        raise ValueError(f"{type(self).__name__} keeps no batches in flight: a checkpoint that has them was "
                         "written by a pipelined run (rollout.staleness > 0)")

    def restore(self, meta: dict, params: list) -> None:
        """A checkpoint's batches in flight (`in_flight().meta`, their parameters), sampled again first."""
        raise ValueError(f"{type(self).__name__} keeps no batches in flight to restore")


class SyncSampler(RolloutSource):
    """Samples with the learner's current parameters on the learner's mesh (a synchronous run).

    `inputs`: what it reads (grpo_jax.rollout.inputs.RolloutInputs: stream, rewards, tokenizer,
    sampling, meshes and host share); `model` is the policy the sampler reads, updated by `sync`."""

    def __init__(self, inputs: RolloutInputs, model: nnx.Module, *, seed: int, shared_prompt: bool,
                 dynamic_sampling: bool, max_resample_rounds: int, reward_control: str = "none"):
        self.inputs, self.model = inputs, model
        self.sampling, self.mesh, self.share = inputs.sampling, inputs.mesh, inputs.share
        # Where it samples: the sampler's own mesh (rollout.sampler_devices), else the learner's.
        self.sample_mesh = inputs.sample_mesh
        self.rows = self.share.scaled(self.sampling.group_size)  # this host's rows of the rollout and batch
        self.seed, self.rng = seed, jax.random.key(seed)
        self.shared_prompt, self.reward_control = shared_prompt, reward_control
        self.dynamic_sampling, self.max_resample_rounds = dynamic_sampling, max_resample_rounds
        # Dynamic sampling with the continuous or paged engine over-samples in one pass (`_stream`).
        self.streaming = dynamic_sampling and engine_of(self.sampling).slots
        self._engine_rounds: list[dict] = []
        if self.streaming and reward_control != "none":
            raise ValueError("reward_control: random compares equal batches across hosts round by round; it "
                             "needs the static engine or train.dynamic_sampling off with sampling.engine continuous or paged")

    def sync(self, params: nnx.State) -> None:
        nnx.update(self.model, params)

    def components(self) -> dict[str, Stateful]:
        return {"data": self.inputs.stream, "rewards": RewardStates(self.inputs.rewards)}

    def use_model(self, model: nnx.Module) -> None:
        """Sample with `model` from now on (a pipelined run's own copy on the sampler's devices)."""
        self.model = model

    def next(self, step: int) -> Trajectories:
        G = self.sampling.group_size
        self._engine_rounds = []  # each round's engine/* metrics (the paged engine's)
        if self.streaming:
            c = self._stream(step)
        else:
            c = collect(functools.partial(self._round, step), num_groups=self.share.size, group_size=G,
                        dynamic_sampling=self.dynamic_sampling, max_resample_rounds=self.max_resample_rounds,
                        any_short=any_host)
        prompts = [ex.prompt_ids for ex in c.examples]
        prompt_ids, prompt_mask = pad_prompts(prompts, common_bucket(prompts, self.sampling.prompt_buckets),
                                              self.sampling.pad_id)
        engine = {}
        if self._engine_rounds:
            engine = {"engine/preemptions": sum(r["engine/preemptions"] for r in self._engine_rounds)}
            used = [r["engine/pages_used_frac"] for r in self._engine_rounds if "engine/pages_used_frac" in r]
            if used:  # rounds on the lock-step loop have no pages
                engine["engine/pages_used_frac"] = float(np.mean(used))
        return self._trajectories(c, prompt_ids, prompt_mask, engine)

    def _trajectories(self, c: Collected, prompt_ids, prompt_mask, extra: dict | None = None) -> Trajectories:
        """The collected groups on the mesh with their prompts (ids and mask [N, P], one row per
        group), the token count an update reads, and the metrics (with `extra`)."""
        G = self.sampling.group_size
        rows = train_rows(c, prompt_ids, prompt_mask, G)
        prompt_tokens = prompt_mask.sum() * (1 if self.shared_prompt else G)
        tokens = sum_over_shares({"t": prompt_tokens + rows.completion_mask.sum()}, self.share)["t"]
        metrics, pass_rates = self._metrics(c)
        metrics.update(extra or {})
        return Trajectories(rows=to_global(rows, self.mesh, self.rows), group_size=G, tokens=int(tokens),
                            metrics=metrics, log=SampleLog(first=c.first, pass_rates=pass_rates))

    def _round(self, step: int, round_index: int) -> Round:
        """One sampling round of this host's block of prompts: sampled on the mesh, scored here."""
        examples = self.inputs.stream.next_batch(self.share.size)
        t0 = time.perf_counter()
        rollout, stats = generate_with_stats(
            self.model, to_global(self._prompt_arrays(examples), self.sample_mesh, self.share), self.sampling,
            step_key(self.rng, step, round_index), mesh=self.sample_mesh)
        if metrics := engine_metrics(stats):
            self._engine_rounds.append(metrics)
        rows = SampleRows.of(rollout, read=lambda arrays: local_rows(arrays, self.rows),
                             read_prompts=lambda arrays: local_rows(arrays, self.share))
        return self._score(step, round_index, examples, rows, sample_s=time.perf_counter() - t0)

    def _prompt_arrays(self, examples) -> tuple[np.ndarray, np.ndarray]:
        prompts = [ex.prompt_ids for ex in examples]
        return pad_prompts(prompts, common_bucket(prompts, self.sampling.prompt_buckets), self.sampling.pad_id)

    def _stream(self, step: int) -> Collected:
        """Over-sampling in one pass (`rollout.stream`): the continuous or paged engine gets as many
        candidate prompts as the resampling rounds could have drawn (1 + max_resample_rounds
        times the step's), and stops once every host has its informative groups."""
        G = self.sampling.group_size
        share = self.share.scaled(1 + self.max_resample_rounds)  # this host's block of the candidates
        examples = self.inputs.stream.next_batch(share.size)
        rows_share = share.scaled(G)

        def read(out: dict) -> dict:
            return dict(zip(out, local_rows(tuple(out.values()), rows_share)))

        stream = EngineStream(self.model, to_global(self._prompt_arrays(examples), self.sample_mesh, share),
                              self.sampling, step_key(self.rng, step, 0), mesh=self.sample_mesh,
                              segment_steps=self.sampling.segment_steps, read=read)

        def score(new: np.ndarray) -> Round:
            rows = SampleRows.concat([stream.group_rows(int(i)) for i in new])
            return self._score(step, 0, [examples[int(i)] for i in new], rows, sample_s=0.0)

        collected = stream_collect(stream, score, num_groups=self.share.size, group_size=G, any_short=any_host)
        if metrics := engine_metrics(stream.engine_stats):
            self._engine_rounds.append(metrics)
        return collected

    def _score(self, step: int, round_index: int, examples, rows: SampleRows, *, sample_s: float) -> Round:
        """Decode and score sampled groups of this host (`rows`: G rows per example)."""
        p, G = self.inputs, self.sampling.group_size
        t1 = time.perf_counter()
        texts = decode_completions(p.tokenizer, rows.tokens, rows.lengths)
        fields = {**repeat_fields(examples, G), "completion_tokens": rows.lengths.tolist()}
        result = combine_rewards(p.rewards, [ex.prompt_text for ex in examples for _ in range(G)], texts, fields)
        scores = None
        if self.reward_control == "random":
            everyone = gather_rows(result.total, self.rows)
            judged = everyone[~np.isnan(everyone)]
            mean = float(judged.mean()) if judged.size else float("nan")  # the whole batch's mean reward
            rng = np.random.default_rng([self.seed, step, round_index, self.rows.start])
            scores = random_control(result.total, mean, rng)
        return Round(examples=examples, rows=rows, texts=texts, rewards=result, sample_s=sample_s,
                     reward_s=time.perf_counter() - t1, scores=scores)

    def _metrics(self, c: Collected) -> tuple[dict[str, float], np.ndarray]:
        """Reward statistics and health of the first round, dynamic sampling and data counters, put
        together over all hosts -> (metrics, the per-group pass rates)."""
        first = c.first.rewards
        everyone = RewardResult(
            total=gather_rows(first.total, self.rows),
            per_fn={k: gather_rows(v, self.rows) for k, v in first.per_fn.items()},
            failures={k: int(v) for k, v in sum_over_shares(first.failures, self.share).items()},
            messages=first.messages)
        stats = dict(self.inputs.stream.stats)
        epoch = max_over_hosts(stats.pop("epoch"))
        # The same on every host, or its own time:
        local = ("dynamic/rounds", "dynamic/segments", "sample_s", "reward_s")
        counts = sum_over_shares({**{k: v for k, v in c.stats.items() if k not in local},
                                  **{f"data/{k}": v for k, v in stats.items()}}, self.share)
        counts["data/skipped_rows"] = counts["data/skipped_malformed"] + counts["data/skipped_overlong"]
        sample_tokens = counts.pop("sample_tokens")
        G = self.sampling.group_size
        health, pass_rates = rollout_health(
            everyone, gather_rows(distinct_answers(c.first.texts, G), self.share),
            gather_rows(c.first.rows.lengths, self.rows), group_size=G,
            correct_by=self.inputs.correct_by, specs=self.inputs.rewards)
        metrics = {**reward_metrics(everyone, G), **health, **counts, "data/epoch": float(epoch),
                   **{k: c.stats[k] for k in ("dynamic/rounds", "dynamic/segments") if k in c.stats},
                   "perf/sample_s": c.stats["sample_s"],
                   "perf/reward_s": c.stats["reward_s"], "perf/sample_tokens": sample_tokens,
                   "perf/sample_tokens_per_s": sample_tokens / max(c.stats["sample_s"], 1e-9)}
        return metrics, pass_rates
