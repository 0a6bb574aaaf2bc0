"""The soft overlong penalty as a reward function: DAPO's formula in tokens, NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_jax.rewards import RewardSpec, combine_rewards, get_reward_fn


def reference(length, max_length, cache):
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return (max_length - cache - length) / cache
    return -1.0


def test_penalty_matches_the_formula():
    fn = get_reward_fn("overlong")
    lengths = [0, 5, 12, 13, 16, 19, 20, 21, 40]
    got = fn(["p"] * len(lengths), ["c"] * len(lengths), completion_tokens=lengths, max_length=20, cache_length=8)
    np.testing.assert_allclose(got, [reference(n, 20, 8) for n in lengths], atol=1e-6)
    assert got[2] == 0.0 and got[6] == -1.0 and -1 < got[4] < 0


def test_combined_with_a_correctness_reward():
    fn = get_reward_fn("overlong")
    specs = [RewardSpec("math_accuracy", get_reward_fn("math_accuracy")),
             RewardSpec("overlong", lambda p, c, **f: fn(p, c, max_length=10, cache_length=4, **f), weight=0.5)]
    result = combine_rewards(specs, ["1+1="] * 3, ["2", "2", "3"],
                             {"answer": ["2", "2", "2"], "completion_tokens": [3, 8, 12]})
    np.testing.assert_allclose(result.total, [1.0, 1.0 + 0.5 * -0.5, 0.5 * -1.0])


def test_mismatched_or_bad_arguments_are_errors():
    fn = get_reward_fn("overlong")
    with pytest.raises(ValueError, match="token counts"):
        fn(["p"], ["c", "d"], completion_tokens=[1], max_length=4, cache_length=2)
    with pytest.raises(ValueError, match="cache_length"):
        fn(["p"], ["c"], completion_tokens=[1], max_length=4, cache_length=0)


def test_an_odd_token_count_costs_its_own_sample_only():
    fn = get_reward_fn("overlong")
    counts = [5, None, "7", True, -1, 10 ** 30, 12.0, np.int64(16), 20]
    got = fn(["p"] * 9, ["c"] * 9, completion_tokens=counts, max_length=20, cache_length=8)
    assert got == [0.0, None, None, None, None, -1.0, None, reference(16, 20, 8), -1.0]
    specs = [RewardSpec("overlong", lambda p, c, **f: fn(p, c, max_length=20, cache_length=8, **f))]
    result = combine_rewards(specs, ["p"] * 3, ["a", "b", "c"], {"completion_tokens": [5, None, 16]})
    np.testing.assert_allclose(result.per_fn["overlong"], [0.0, np.nan, reference(16, 20, 8)])
    assert result.failures == {}  # not an exception: a count that cannot be judged
