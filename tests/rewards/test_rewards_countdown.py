"""Countdown reward: exact arithmetic on the given numbers, no eval, malformed gold dropped."""

from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
import pytest

from grpo_jax.rewards.combine import RewardSpec, combine_rewards
from grpo_jax.rewards.countdown import countdown_reward, evaluate_expression, extract_expression


def score(completion: str, numbers=(3, 5, 7, 2), target=16, **kwargs) -> float | None:
    return countdown_reward(["q"], [completion], numbers=[list(numbers)], target=[target], **kwargs)[0]


@pytest.mark.parametrize("completion", [
    "<answer>(3 + 5) * 2</answer>",
    "I tried a few. <answer> 2 * (3 + 5) </answer>",
    "so \\boxed{(3+5)*2}",
    "Let me see.\n(3 + 5) * 2 = 16",                    # last line as an equation
    "<answer>7 * 2 + 5 - 3</answer>",
    "<answer>(3 + 5) * 2 = 16</answer>",                # an equation inside the tag
])
def test_correct_expressions_score_one(completion):
    assert score(completion) == 1.0


@pytest.mark.parametrize("completion,why", [
    ("<answer>7 + 5 + 3 + 2</answer>", "17 is not 16"),
    ("<answer>(5 + 3) * 2 * 1</answer>", "1 is not a given number"),
    ("<answer>(5 + 3) + (5 + 3)</answer>", "5 and 3 used twice"),
    ("<answer>16</answer>", "the bare target uses no given numbers"),
    ("<answer>-3 + 5 * 2 + 7 + 2</answer>", "unary minus is not an operator of the game"),
    ("<answer>2 ** 4</answer>", "power is not allowed"),
    ("<answer>7 // 2 * 5</answer>", "floor division is not allowed"),
    ("<answer>__import__('os').system('true')</answer>", "names are not allowed (and never evaluated)"),
    ("<answer>(3 + 5) * 2.0</answer>", "decimals are not allowed"),
    ("<answer>5 / (3 - 3)</answer>", "division by zero is wrong, not a crash"),
    ("<answer>(3 + 5) * 2 = 17</answer>", "a right-hand side that is not the target"),
    ("<answer>(3 + 5) * 2</answer> <answer>7 + 5 + 3 + 2</answer>", "several different answers"),
    ("<answer>(3 + 5) * 2", "an unclosed tag is no answer"),
    ("", "nothing"),
    ("<answer>" + "(" * 150 + "3" + ")" * 150 + "</answer>", "absurd nesting"),
])
def test_wrong_or_malformed_expressions_score_zero(completion, why):
    assert score(completion) == 0.0, why


def test_division_is_exact():
    assert evaluate_expression("7 / 2 * 2") == (Fraction(7), [7, 2, 2])
    assert score("<answer>7 / 2 * 2</answer>", numbers=[7, 2, 2], target=7) == 1.0
    assert score("<answer>7 / 2</answer>", numbers=[7, 2], target=3) == 0.0  # 3.5, not floor 3


def test_repeated_given_numbers_and_use_all():
    assert score("<answer>5 + 5</answer>", numbers=[5, 5, 1], target=10) == 1.0  # 5 given twice
    assert score("<answer>5 + 5</answer>", numbers=[5, 5, 1], target=10, use_all_numbers=True) == 0.0
    assert score("<answer>(5 + 5) * 1</answer>", numbers=[5, 5, 1], target=10, use_all_numbers=True) == 1.0


def test_malformed_gold_is_dropped_not_scored():
    completions = ["<answer>3 + 5</answer>"] * 6
    numbers = [[3, 5], "3 5", [3, "5"], [3, 5], [], np.array([3, 5])]
    target = [8, 8, 8, 8.0, 8, np.int64(8)]
    assert countdown_reward(["q"] * 6, completions, numbers=numbers, target=target) == [1.0, None, None, None, None, 1.0]
    assert score("<answer>3 + 5</answer>", numbers=[True, 5], target=8) is None  # bool is not a number here


def test_extract_expression():
    assert extract_expression("<answer>1+2</answer> and <answer>1+2</answer>") == "1+2"
    assert extract_expression("<answer>1+2</answer> and <answer>2+1</answer>") is None
    assert extract_expression("work\n\n3 * 4\n") == "3 * 4"
    assert extract_expression("   ") is None


def test_lengths_must_agree():
    with pytest.raises(ValueError, match="lengths differ"):
        countdown_reward(["q"], ["a", "b"], numbers=[[1], [1]], target=[1, 1])


# --- issue 25: linear tag pairing, odd samples -----------------------------------------------

MB = 1 << 20


@pytest.mark.parametrize("flood", [
    "<answer>" * (MB // 8),                                  # ~9 s for 128 KB before (the lazy regex rescanned)
    "</answer>" * (MB // 18) + "<answer>" * (MB // 16),
    "<answer>(3 + 5) * 2" * (MB // 20),
])
def test_a_megabyte_of_unclosed_tags_scores_zero_within_a_second(flood):
    start = time.perf_counter()
    assert score(flood) == 0.0
    seconds = time.perf_counter() - start
    assert seconds < 2.0, seconds  # milliseconds; 2 s is a generous bound on a busy machine
    assert score("<answer>(3 + 5) * 2</answer>") == 1.0


@pytest.mark.parametrize("unpaired", [
    "</answer> <answer>(3 + 5) * 2</answer>",               # a closing without an opening
    "<answer><answer>(3 + 5) * 2</answer></answer>",         # a block inside a block
    "<answer>(3 + 5) * 2</answer> <answer>",                 # one left open after the answer
])
def test_answer_tags_that_do_not_pair_up_are_no_answer(unpaired):
    assert extract_expression(unpaired) is None
    assert score(unpaired) == 0.0


def test_only_ascii_digits_are_numbers():
    assert score("<answer>(\u0663 + \u0665) * \u0662</answer>") == 0.0  # Arabic-Indic 3, 5, 2
    assert score("<answer>(3\u00a0+ 5) * 2</answer>") == 0.0            # a no-break space
    assert score("<answer>(3 + 5) * 2</answer>") == 1.0


def test_a_poisoned_sample_among_good_ones():
    good, wrong = "<answer>(3 + 5) * 2</answer>", "<answer>7 + 5 + 3 + 2</answer>"
    completions = [good, "<answer>" * 10_000, "\ud800\x00", good, wrong, good]
    numbers = [[3, 5, 7, 2], [3, 5, 7, 2], [3, 5, 7, 2], np.array(3), [3, 5, 7, 2], np.array([[3, 5], [7, 2]])]
    assert countdown_reward(["q"] * 6, completions, numbers=numbers, target=[16] * 6) == [1.0, 0.0, 0.0, None, 0.0,
                                                                                           None]
    specs = [RewardSpec("countdown", countdown_reward)]
    result = combine_rewards(specs, ["q"] * 4, [good, None, wrong, good],  # None raises in tag_blocks
                             {"numbers": [[3, 5, 7, 2]] * 4, "target": [16] * 4})
    np.testing.assert_array_equal(result.per_fn["countdown"], [1.0, np.nan, 0.0, 1.0])
    assert result.failures == {"countdown": 1}
