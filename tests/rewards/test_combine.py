"""Combining reward functions: weights, None propagation, failures counted, bugs named."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_jax.rewards.combine import RewardSpec, combine_rewards
from grpo_jax.rewards.math import math_accuracy


def length_bonus(prompts, completions, **_):
    return [min(len(c), 10) / 10 for c in completions]


def test_weighted_sum_and_per_function_means():
    prompts = ["q"] * 3
    completions = ["#### 5", "#### 4", "\\boxed{5} and then some more text"]
    specs = [RewardSpec("accuracy", math_accuracy, 1.0), RewardSpec("length", length_bonus, 0.5)]
    result = combine_rewards(specs, prompts, completions, {"answer": ["#### 5", "#### 5", "#### five"]})
    np.testing.assert_allclose(result.per_fn["accuracy"][:2], [1.0, 0.0])
    assert np.isnan(result.per_fn["accuracy"][2])  # unparsable gold
    np.testing.assert_allclose(result.total[:2], [1.0 + 0.5 * 0.6, 0.0 + 0.5 * 0.6], rtol=1e-6)
    assert np.isnan(result.total[2])  # dropped, not scored as 0
    m = result.metrics()
    assert m["reward/accuracy/mean"] == 0.5 and m["reward/length/mean"] == pytest.approx((0.6 + 0.6 + 1.0) / 3)


def test_a_raising_function_drops_its_samples_and_is_counted():
    def broken(prompts, completions, **_):
        raise RuntimeError("verifier crashed")

    result = combine_rewards([RewardSpec("ok", length_bonus), RewardSpec("broken", broken)], ["a", "b"], ["x", "y"])
    assert np.isnan(result.total).all()
    assert result.failures == {"broken": 2} and "verifier crashed" in result.messages["broken"]


@pytest.mark.parametrize("bad,match", [
    (lambda p, c, **_: [1.0], "returned 1 values for 2"),
    (lambda p, c, **_: [1.0, float("nan")], "returned nan for sample 1"),
    (lambda p, c, **_: [1.0, "1"], "returned '1'"),
    (lambda p, c, **_: [True, 1.0], "returned True"),
])
def test_buggy_functions_fail_loudly_with_their_name(bad, match):
    with pytest.raises(ValueError, match=f"'buggy' {match}" if "values" in match else match):
        combine_rewards([RewardSpec("buggy", bad)], ["a", "b"], ["x", "y"])


def test_bad_inputs():
    with pytest.raises(ValueError, match="no reward functions"):
        combine_rewards([], ["a"], ["x"])
    with pytest.raises(ValueError, match="unique"):
        combine_rewards([RewardSpec("a", length_bonus), RewardSpec("a", length_bonus)], ["a"], ["x"])
    with pytest.raises(ValueError, match="field 'answer' has 1 values for 2"):
        combine_rewards([RewardSpec("a", length_bonus)], ["a", "b"], ["x", "y"], {"answer": ["1"]})
