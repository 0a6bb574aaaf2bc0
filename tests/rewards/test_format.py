"""Format reward: reasoning then exactly one final answer, and the shapes that must score 0."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from grpo_jax.rewards.combine import RewardSpec, combine_rewards
from grpo_jax.rewards.format import INTEGER_PATTERN, format_reward, tag_blocks

PROMPT = "Natalia sold clips to 48 of her friends in April, and half as many in May. How many clips in total?"
REASONING = "In May she sold 48 / 2 = 24 clips. Altogether 48 + 24 = 72 clips."


def score(completion: str, prompt: str = PROMPT, **kwargs) -> float | None:
    return format_reward([prompt], [completion], **kwargs)[0]


@pytest.mark.parametrize("completion", [
    f"{REASONING} So the answer is \\boxed{{72}}.",
    f"{REASONING}\n\n\\boxed{{72}}",
    f"{REASONING} \\boxed{{\\frac{{144}}{{2}}}}",             # nested braces in the box
])
def test_reasoning_then_one_boxed_answer_scores_one(completion):
    assert score(completion) == 1.0


@pytest.mark.parametrize("completion,why", [
    (f"{REASONING} \\boxed{{72}} or maybe \\boxed{{48}}", "several different boxed answers"),
    (f"{REASONING} \\boxed{{72}}, i.e. \\boxed{{72}}", "two answers, even if they agree: the form asks for one"),
    (PROMPT + " \\boxed{72}", "an echo of the question is not reasoning"),
    (f"{PROMPT} {PROMPT} {PROMPT} \\boxed{{72}}", "the question repeated"),
    ("\\boxed{72}", "no reasoning"),
    ("72", "a number-only string"),
    ("The answer is \\boxed{72}", "a few filler words are not reasoning"),
    (f"{REASONING} \\boxed{{}}", "an empty answer"),
    (f"{REASONING} \\boxed{{72", "an unclosed box (a truncated completion)"),
    (f"{REASONING} \\boxed{{72}}. Then I kept going with a lot more text after the final answer.", "the answer is not at the end"),
    (REASONING, "no final answer"),
    ("", "empty"),
])
def test_malformed_completions_score_zero(completion, why):
    assert score(completion) == 0.0, why


def test_gsm8k_style():
    assert score(f"{REASONING}\n#### 72", answer_style="gsm8k") == 1.0
    assert score(f"{REASONING}\n#### 72\n#### 73", answer_style="gsm8k") == 0.0  # two answers
    assert score(f"{REASONING} #### 72", answer_style="gsm8k") == 0.0  # not on its own line
    assert score("#### 72", answer_style="gsm8k") == 0.0  # no reasoning
    assert score(f"{REASONING}\n\\boxed{{72}}", answer_style="gsm8k") == 0.0  # the wrong form


def test_tag_style_with_reasoning_tag():
    kwargs = dict(answer_style="tag", reasoning_tag="think")
    assert score(f"<think>{REASONING}</think>\n<answer>72</answer>", **kwargs) == 1.0
    assert score(f"<think>{REASONING}</think><answer>72</answer><answer>48</answer>", **kwargs) == 0.0
    assert score("<think></think><answer>72</answer>", **kwargs) == 0.0  # empty reasoning
    assert score(f"{REASONING}<answer>72</answer>", **kwargs) == 0.0  # reasoning outside the block
    assert score(f"<answer>72</answer><think>{REASONING}</think>", **kwargs) == 0.0  # reasoning after the answer
    assert score(f"<think>{REASONING}</think><answer>72", **kwargs) == 0.0  # unclosed answer
    assert score(f"{REASONING}<result>72</result>", answer_style="tag", answer_tag="result") == 1.0


def test_answer_pattern_and_optional_reasoning():
    assert score(f"{REASONING} \\boxed{{72}}", answer_pattern=r"-?\d+") == 1.0
    assert score(f"{REASONING} \\boxed{{seventy-two}}", answer_pattern=r"-?\d+") == 0.0
    assert score("\\boxed{72}", require_reasoning=False) == 1.0
    assert score("72", require_reasoning=False) == 0.0  # still needs the answer form
    assert score("ok: \\boxed{72}", min_reasoning_chars=2) == 1.0  # was min 3: the colon counted then
    assert score("ok: \\boxed{72}", min_reasoning_chars=3) == 0.0  # letters and digits count, not punctuation


def test_bad_configuration_fails_early():
    with pytest.raises(ValueError, match="answer_style must be one of"):
        format_reward(["q"], ["a"], answer_style="xml")
    with pytest.raises(ValueError, match="bare tag name"):
        format_reward(["q"], ["a"], answer_style="tag", answer_tag="<answer>")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        format_reward(["q"], ["a"], answer_pattern="(")
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        format_reward(["q", "q"], ["a"])


def test_restating_the_question_is_fine_when_most_of_the_text_is_the_models_own():
    long_reasoning = ("First the April sales: she sold 48 clips. May was half of that, 48 / 2 = 24 clips. "
                      "Adding both months gives 48 + 24 = 72 clips, which is the total we want.")
    assert score(f"{PROMPT}\n{long_reasoning} \\boxed{{72}}") == 1.0
    mostly_copied = f"{PROMPT}\n{REASONING} \\boxed{{72}}"  # 19 copied words, 15 own
    assert score(mostly_copied) == 0.0
    assert score(mostly_copied, max_echo_fraction=0.9) == 1.0


# --- issue 25: reasoning made of words, nothing but closing marks after the answer, one integer,
# linear tag pairing --------------------------------------------------------------------------

MB = 1 << 20


@pytest.mark.parametrize("filler", [
    "." * 30, "\x00" * 30, "\u200b" * 30, "\ud800" * 30, "\u200d\ufeff\u2060" * 10, "- * " * 10, "\u0301" * 30,
    "\x00\u200b.\ud800" * 10,
])
def test_reasoning_must_contain_words(filler):
    assert score(f"{filler} \\boxed{{72}}") == 0.0
    assert score(f"<think>{filler}</think><answer>72</answer>", answer_style="tag", reasoning_tag="think") == 0.0
    assert score(f"{REASONING} \\boxed{{72}}") == 1.0  # control
    assert score(f"{filler} {REASONING} \\boxed{{72}}") == 1.0  # filler beside real words does not hurt


@pytest.mark.parametrize("trailing", [
    " or 48", ". 48", " (or 48)", ", maybe 48.", " \\boxed", " 🎉", "\x00", "\u200b", " # 48", " = 48",
    " + 1", "<answer>48</answer>", " </or48>", " \\end{48}",
])
def test_only_punctuation_and_closing_markup_may_follow_the_answer(trailing):
    assert score(f"{REASONING} \\boxed{{72}}{trailing}") == 0.0


@pytest.mark.parametrize("wrapped", [
    "\\boxed{72}.", "$\\boxed{72}$.", "\\[\\boxed{72}\\]", "**\\boxed{72}**", "\\(\\boxed{72}\\)!",
    "\\boxed{72} </think>", "\\begin{align} x &= \\boxed{72} \\end{align}", "\\boxed{72}\n\n",
])
def test_closing_markup_after_the_answer_is_fine(wrapped):
    assert score(f"{REASONING} {wrapped}") == 1.0


def test_an_answer_that_shows_nothing_is_no_answer():
    for content in ["\u200b", "\x00", "\u200b\u2060", "\ud800", " \u00a0 "]:
        assert score(f"{REASONING} \\boxed{{{content}}}") == 0.0
    assert score(f"{REASONING} \\boxed{{72}}") == 1.0


@pytest.mark.parametrize("answer,ok", [
    ("72", True), ("-5", True), ("1,234", True), ("12,345,678", True), ("0", True),
    ("0,1,2,3,4,5,6,7,8,9,10,500", False), ("0,1,2", False), ("1,23", False), ("12,345,67", False),
    ("1,2345", False), (",", False), ("-", False), ("1.5", False), ("72 or 48", False),
])
def test_the_integer_pattern_matches_one_integer(answer, ok):
    assert (re.fullmatch(INTEGER_PATTERN, answer) is not None) == ok
    assert score(f"{REASONING} \\boxed{{{answer}}}", answer_pattern=INTEGER_PATTERN) == (1.0 if ok else 0.0)


def test_a_pattern_is_not_run_on_a_huge_answer():
    assert score(f"{REASONING} \\boxed{{{'1' * 2000}}}", answer_pattern=INTEGER_PATTERN) == 0.0
    assert score(f"{REASONING} \\boxed{{{'1' * 900}}}", answer_pattern=INTEGER_PATTERN) == 1.0


def test_tag_blocks_pair_tags_in_one_pass():
    assert tag_blocks("a<t>x</t>b<t>y</t>", "t") == [(1, 9, "x"), (10, 18, "y")]
    assert tag_blocks("no tags", "t") == []
    for unpaired in ["<t>x", "x</t>", "</t><t>x</t>", "<t><t>x</t></t>", "<t>x</t></t>", "<t>x<t>y</t>"]:
        assert tag_blocks(unpaired, "t") is None, unpaired


@pytest.mark.parametrize("flood", [
    "<answer>" * (MB // 8), "</answer>" * (MB // 18) + "<answer>" * (MB // 16), "<think>" * (MB // 7),
    "<answer>x" * (MB // 9), "\\boxed{" * (MB // 7),
])
def test_a_megabyte_of_unclosed_tags_scores_zero_within_a_second(flood):
    for kwargs in [dict(answer_style="tag"), dict(answer_style="tag", reasoning_tag="think"), {},
                   dict(answer_style="gsm8k")]:
        start = time.perf_counter()
        assert score(flood, **kwargs) == 0.0
        seconds = time.perf_counter() - start
        assert seconds < 2.0, (kwargs, seconds)  # about 0.1 s; 2 s is a generous bound on a busy machine
    assert score(f"<think>{REASONING}</think>\n<answer>72</answer>", answer_style="tag", reasoning_tag="think") == 1.0


def test_a_poisoned_sample_among_good_ones():
    good, bad = f"{REASONING} \\boxed{{72}}", f"{REASONING} \\boxed{{72}} or 48"
    odd = ["<answer>" * 10_000, "\ud800" * 100, "\x00" * 100, "\\boxed{" * 1000 + "}"]
    assert format_reward([PROMPT] * 6, [good, *odd, bad]) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    specs = [RewardSpec("format", format_reward)]
    result = combine_rewards(specs, [PROMPT] * 4, [good, None, bad, good])  # None raises inside strip_echo
    np.testing.assert_array_equal(result.per_fn["format"], [1.0, np.nan, 0.0, 1.0])
    assert result.failures == {"format": 1}
