"""Countdown reward: exact arithmetic on the given numbers, no eval, malformed gold dropped."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

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
    ("<answer>(3 + 5) * 2", "an unclosed tag falls back to the last line, which has a tag in it"),
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
