"""Combining reward functions: weights, None propagation, failures counted, bugs named."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_jax.rewards.combine import RewardSpec, combine_rewards
from grpo_jax.rewards.math import math_accuracy
from grpo_jax.rollout.collect import reward_metrics


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


# --- issue 25: one sample's failure costs that sample only ------------------------------------

def poisoned(prompts, completions, **_):
    """Raises on the whole call when any completion is neither 'ok' nor 'no', as a verifier with a bug would."""
    return [{"ok": 1.0, "no": 0.0}[c] for c in completions]


def test_a_sample_that_raises_costs_that_sample_only():
    specs = [RewardSpec("poisoned", poisoned), RewardSpec("length", length_bonus, 0.5)]
    result = combine_rewards(specs, ["q"] * 4, ["ok", "no", "poison", "ok"])
    np.testing.assert_array_equal(result.per_fn["poisoned"], [1.0, 0.0, np.nan, 1.0])
    np.testing.assert_allclose(result.per_fn["length"], [0.2, 0.2, 0.6, 0.2], rtol=1e-6)
    np.testing.assert_allclose(result.total, [1.1, 0.1, np.nan, 1.1], rtol=1e-6)
    assert result.failures == {"poisoned": 1}
    assert result.messages["poisoned"] == "KeyError: 'poison' (sample 2)"
    assert result.metrics()["reward/poisoned/unjudged"] == 0.0  # lost to an exception, counted as a failure


def test_the_issue_example_a_309_digit_number_among_good_answers():
    completions = ["\\boxed{5}", "\\boxed{6}", "\\boxed{1" + "0" * 309 + "}"]  # was [nan, nan, nan]
    result = combine_rewards([RewardSpec("accuracy", math_accuracy)], ["q"] * 3, completions, {"answer": ["5"] * 3})
    np.testing.assert_array_equal(result.total, [1.0, 0.0, 0.0])
    assert result.failures == {}


def test_each_sample_is_retried_with_its_own_fields():
    calls = []

    def batch_only_bug(prompts, completions, *, answer, **_):
        calls.append(len(completions))
        if len(completions) > 1:
            raise MemoryError("batch too large")
        return [1.0 if completions[0] == answer[0] else 0.0]

    result = combine_rewards([RewardSpec("b", batch_only_bug)], ["p", "q", "r"], ["1", "2", "3"],
                             {"answer": ["1", "5", "3"]})
    np.testing.assert_array_equal(result.total, [1.0, 0.0, 1.0])
    assert calls == [3, 1, 1, 1] and result.failures == {}


def test_a_bug_found_on_the_retry_still_fails_loudly():
    def wrong_length_alone(prompts, completions, **_):
        if len(completions) > 1:
            raise RuntimeError("batch")
        return [1.0, 1.0]

    with pytest.raises(ValueError, match="'buggy' returned 2 values for 1"):
        combine_rewards([RewardSpec("buggy", wrong_length_alone)], ["a", "b"], ["x", "y"])
    with pytest.raises(ValueError, match="returned inf"):
        combine_rewards([RewardSpec("inf", lambda p, c, **_: [1.0, float("inf")])], ["a", "b"], ["x", "y"])


def test_a_reward_beyond_float32_fails_its_sample_alone():
    """1e300 is finite in float64 but inf in float32, the loss's dtype: that sample is dropped and
    counted with the function's failures; a weighted total past float32 is dropped too."""
    result = combine_rewards([RewardSpec("big", lambda p, c, **_: [1.0, 1e300, -(10 ** 400), 3e38]),
                              RewardSpec("also", lambda p, c, **_: [0.0, 0.0, 0.0, 3e38])], ["q"] * 4, list("abcd"))
    assert np.isfinite(result.total[0]) and np.isnan(result.total[1:]).all()
    assert result.failures == {"big": 2} and "returned 1e+300 for sample 1, beyond float32" in result.messages["big"]
    assert np.isfinite(result.per_fn["big"][[0, 3]]).all() and np.isnan(result.per_fn["big"][1:3]).all()
    assert reward_metrics(result, group_size=2)["reward/dropped"] == 3.0


@pytest.mark.parametrize("name,fields,good,bad", [
    ("math_accuracy", {"answer": "5"}, "\\boxed{5}", "\\boxed{6}"),
    ("format", {}, "Half of 48 is 24, and 48 + 24 = 72 in all. \\boxed{72}", "\\boxed{72}"),
    ("countdown", {"numbers": [3, 5, 7, 2], "target": 16}, "<answer>(3 + 5) * 2</answer>", "<answer>3 + 5</answer>"),
])
def test_every_built_in_keeps_its_good_samples_beside_a_poisoned_one(name, fields, good, bad):
    from grpo_jax.rewards import get_reward_fn

    completions = [good, None, bad, good]  # None is no text: every built-in raises on it
    result = combine_rewards([RewardSpec(name, get_reward_fn(name))], ["q"] * 4, completions,
                             {k: [v] * 4 for k, v in fields.items()})
    np.testing.assert_array_equal(result.per_fn[name], [1.0, np.nan, 0.0, 1.0])
    assert result.failures == {name: 1} and "(sample 1)" in result.messages[name]


def test_a_stateful_reward_rescores_a_failed_batch_without_updating_its_statistics():
    class Counting:  # the shape of grpo_jax.rewards.stateful.StatefulReward's scoring side
        def __init__(self):
            self.updates = 0

        def __call__(self, prompts, completions, **fields):
            if len(completions) > 1:
                raise RuntimeError("batch failed")
            self.updates += 1
            return [1.0]

        def without_updates(self):
            return lambda prompts, completions, **fields: [2.0] * len(completions)

    reward = Counting()
    result = combine_rewards([RewardSpec("rm", reward)], ["p", "q"], ["a", "b"])
    assert result.total.tolist() == [2.0, 2.0] and reward.updates == 0
