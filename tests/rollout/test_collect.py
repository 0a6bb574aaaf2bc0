"""Sampling rounds with dynamic sampling, and what is logged of them, tested without a model: the
draw function hands out rounds of made-up rewards."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from grpo_jax.engine.draw import SampleRows
from grpo_jax.rewards import RewardResult
from grpo_jax.rollout.collect import Round, collect, reward_metrics, sample_records, step_key

G = 4


class Example:
    def __init__(self, name):
        self.prompt_text, self.fields = name, {}


def make_round(index: int, group_rewards: list[list[float]]) -> Round:
    """A round whose group i has `group_rewards[i]`; every row's token ids say (round, group, sample)."""
    n = len(group_rewards)
    total = np.asarray(group_rewards, np.float32).reshape(-1)
    ids = np.asarray([[index, i, j] for i in range(n) for j in range(G)], np.int32)
    rows = SampleRows(tokens=ids, logprobs=ids.astype(np.float32), mask=np.ones_like(ids),
                      truncated=np.zeros(n * G, bool), lengths=np.full(n * G, 3, np.int32))
    return Round(examples=[Example(f"r{index}g{i}") for i in range(n)], rows=rows,
                 texts=[f"r{index}g{i}s{j}" for i in range(n) for j in range(G)],
                 rewards=RewardResult(total=total, per_fn={"acc": total}, failures={"acc": 0}, messages={}),
                 sample_s=0.5, reward_s=0.25)


MIXED, SAME, NONE = [0, 1, 0, 0], [1, 1, 1, 1], [np.nan, 1, np.nan, np.nan]


def drawer(rounds):
    calls = []

    def draw(i):
        calls.append(i)
        return make_round(i, rounds[i])

    return draw, calls


def groups_of(collected):
    return [tuple(collected.rows.tokens[k * G, :2]) for k in range(len(collected.examples))]


def test_without_dynamic_sampling_the_first_round_is_the_batch():
    draw, calls = drawer([[SAME, MIXED, SAME]])
    c = collect(draw, num_groups=3, group_size=G, dynamic_sampling=False, max_resample_rounds=5)
    assert calls == [0]
    assert groups_of(c) == [(0, 0), (0, 1), (0, 2)]
    np.testing.assert_array_equal(c.rewards, np.asarray([SAME, MIXED, SAME], np.float32).reshape(-1))
    assert c.stats["dynamic/dropped_groups"] == 0 and c.stats["dynamic/filled_groups"] == 0
    assert c.stats["sample_tokens"] == 3 * G * 3 and c.stats["sample_s"] == 0.5 and c.stats["reward_s"] == 0.25


def test_dynamic_sampling_keeps_signal_and_resamples_until_full():
    draw, calls = drawer([[SAME, MIXED, NONE], [MIXED, SAME, SAME], [SAME, SAME, MIXED]])
    c = collect(draw, num_groups=3, group_size=G, dynamic_sampling=True, max_resample_rounds=5)
    assert calls == [0, 1, 2]  # two groups with signal after round 1, the third in round 2
    assert groups_of(c) == [(0, 1), (1, 0), (2, 2)]
    assert [ex.prompt_text for ex in c.examples] == ["r0g1", "r1g0", "r2g2"]
    assert not np.isnan(c.rewards).any()
    np.testing.assert_array_equal(c.rows.logprobs[:, 0], np.repeat([0, 1, 2], G))
    assert c.stats == {"dynamic/rounds": 3.0, "dynamic/dropped_groups": 6.0, "dynamic/filled_groups": 0.0,
                       "sample_tokens": 3.0 * 3 * G * 3, "sample_s": 1.5, "reward_s": 0.75}
    assert c.first.examples[0].prompt_text == "r0g0"  # statistics describe the first round


def test_a_batch_still_short_is_filled_with_copies_that_carry_no_reward():
    draw, calls = drawer([[SAME, MIXED, SAME]] * 3)
    c = collect(draw, num_groups=3, group_size=G, dynamic_sampling=True, max_resample_rounds=2)
    assert calls == [0, 1, 2]  # 1 + max_resample_rounds rounds, then it stops
    assert groups_of(c) == [(0, 1), (1, 1), (2, 1)]  # the mixed group of each round
    draw, _ = drawer([[SAME, SAME]] * 2)
    c = collect(draw, num_groups=2, group_size=G, dynamic_sampling=True, max_resample_rounds=1)
    assert groups_of(c) == [(0, 0), (0, 1)]  # filler: set-aside groups, in order
    assert np.isnan(c.rewards).all() and c.stats["dynamic/filled_groups"] == 2
    assert c.stats["dynamic/dropped_groups"] == 4


def test_rounds_continue_while_any_host_is_short():
    # This host is full after one round, another host is not: the collective decision says go on.
    draw, calls = drawer([[MIXED, MIXED]] * 4)
    asked = []
    c = collect(draw, num_groups=2, group_size=G, dynamic_sampling=True, max_resample_rounds=3,
                any_short=lambda short: asked.append(short) or len(asked) < 3)
    assert calls == [0, 1, 2] and asked == [False, False, False]
    assert groups_of(c) == [(0, 0), (0, 1)]


def test_reward_metrics_against_numpy():
    rnd = make_round(0, [MIXED, SAME, NONE, [0.5, np.nan, 0.25, 1.0]])
    m = reward_metrics(rnd.rewards, G)
    total = rnd.rewards.total
    judged = total[~np.isnan(total)]
    assert m["reward/mean"] == pytest.approx(judged.mean()) and m["reward/std"] == pytest.approx(judged.std())
    assert m["groups/frac_zero_std"] == 0.5  # SAME, and NONE (one judged sample)
    assert m["reward/dropped"] == 4.0 and m["reward/acc/failures"] == 0.0
    records = sample_records(rnd, G, 2)
    assert [r["prompt"] for r in records] == ["r0g0", "r0g1"] and records[1]["reward"] == 1.0
    assert not any("env_error" in r for r in records)
    # An episode that failed says why in samples.jsonl.
    rnd.errors = ["environment.reset: TemplateRefused: roles must alternate"] + [None] * (len(rnd.texts) - 1)
    assert [r.get("env_error") for r in sample_records(rnd, G, 2)] == [rnd.errors[0], None]


def test_every_step_and_round_gets_its_own_key():
    rng = jax.random.key(0)
    keys = {tuple(np.asarray(jax.random.key_data(step_key(rng, s, r))).tolist())
            for s in range(1, 4) for r in range(100)}
    assert len(keys) == 300  # step * 64 + round would repeat keys from round 64 on


def routed_round(index: int, group_rewards: list[list[float]], bucket: int) -> Round:
    """`make_round` of a mixture-of-experts policy: row (group i, sample j) routed every completion
    token to experts 16 * index + G * i + j, its prompt's real tokens (the last i % 3 + 1 slots of
    this round's prompt bucket) to 128 + 8 * index + i, its padding to 0."""
    rnd = make_round(index, group_rewards)
    n, M, L, K = len(group_rewards), rnd.rows.tokens.shape[1], 2, 2
    row = 16 * index + np.arange(n * G)
    prompt = np.zeros((n * G, bucket, L, K), np.uint8)
    for r in range(n * G):
        i = r // G
        prompt[r, bucket - (i % 3 + 1):] = 128 + 8 * index + i
    experts = np.broadcast_to(row[:, None, None, None], (n * G, M, L, K)).astype(np.uint8)
    rnd.rows = rnd.rows.replace(experts=experts, prompt_experts=prompt)
    return rnd


def test_experts_follow_their_rows_from_rounds_to_the_train_batch():
    """Dynamic sampling over rounds sampled in different prompt buckets drops uniform groups and
    fills the batch from later rounds: each row's experts are still its own, its prompt's moved to
    the batch's bucket; the train rows, placed on a (2, 2, 2) mesh and read back, and the learner's
    Batch carry them."""
    from grpo_jax.learner.learner import Learner
    from grpo_jax.rollout.source import Trajectories, train_rows
    from grpo_jax.runtime.hosts import local_rows, to_global, whole
    from grpo_jax.runtime.sharding import make_mesh
    from grpo_jax.config import MeshConfig

    buckets = [6, 4, 8]
    rounds = [[SAME, MIXED, NONE], [MIXED, SAME, SAME], [SAME, SAME, MIXED]]
    c = collect(lambda i: routed_round(i, rounds[i], buckets[i]), num_groups=3, group_size=G, dynamic_sampling=True,
                max_resample_rounds=5)
    chosen = groups_of(c)
    assert chosen == [(0, 1), (1, 0), (2, 2)]
    for k, (index, i) in enumerate(chosen):
        rows = slice(k * G, (k + 1) * G)
        assert (c.rows.experts[rows] == (16 * index + G * i + np.arange(G))[:, None, None, None]).all()
        assert c.rows.prompt_experts.shape[1] == 8  # the widest round's bucket
        assert (c.rows.prompt_experts[rows, -(i % 3 + 1):] == 128 + 8 * index + i).all()
        assert (c.rows.prompt_experts[rows, :-(i % 3 + 1)] == 0).all()
    # The batch's prompt bucket (the chosen prompts' longest, 3 tokens, fits 4).
    P = 4
    prompt_ids = np.zeros((3, P), np.int32)
    prompt_mask = np.asarray([[0] * (P - (i % 3 + 1)) + [1] * (i % 3 + 1) for _, i in chosen], np.int32)
    t = train_rows(c, prompt_ids, prompt_mask, G)
    assert t.prompt_experts.shape == (3 * G, P, 2, 2) and t.completion_experts.shape == (3 * G, 3, 2, 2)
    np.testing.assert_array_equal(t.prompt_experts[:, -1], c.rows.prompt_experts[:, -1])
    real = np.repeat(prompt_mask, G, axis=0).astype(bool)
    assert (t.prompt_experts[~real] == 0).all() and (t.prompt_experts[real] >= 128).all()

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    placed = to_global(t, mesh, whole(3 * G))
    assert placed.completion_experts.sharding.spec[0] == ("data", "fsdp", "expert")  # rows split over 4 shards
    back = local_rows(placed, whole(3 * G))
    np.testing.assert_array_equal(back.completion_experts, t.completion_experts)
    np.testing.assert_array_equal(back.prompt_experts, t.prompt_experts)

    class Plain:  # what Learner.complete asks of the learner, for a plain batch (no reference, teacher, packing)
        frozen = teacher = None
        beta = 0.0

        def advantages(self, rewards):
            from grpo_jax.learner.grpo import group_advantages
            return group_advantages(rewards, G)

        def pack(self, batch):
            return batch, None

    trajectories = Trajectories(rows=placed, group_size=G, tokens=0, metrics={}, log=None)
    batch, _ = Learner.complete(Plain(), trajectories)
    np.testing.assert_array_equal(np.asarray(batch.completion_experts), t.completion_experts)
    np.testing.assert_array_equal(np.asarray(batch.prompt_experts), t.prompt_experts)
