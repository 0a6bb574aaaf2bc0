"""Format reward: reasoning then exactly one final answer, and the shapes that must score 0."""

from __future__ import annotations

import pytest

from grpo_jax.rewards.format import format_reward

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
    assert score("ok: \\boxed{72}", min_reasoning_chars=3) == 1.0


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
