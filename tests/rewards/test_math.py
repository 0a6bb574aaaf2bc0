"""Math answer extraction and the accuracy reward, including answers that must score 0."""

from __future__ import annotations

import pytest

from grpo_jax.rewards.math import extract_answer, math_accuracy, parse_number, strip_echo


@pytest.mark.parametrize("text,value", [
    ("42", 42.0), ("-3.5", -3.5), ("1,234", 1234.0), ("3/4", 0.75), ("\\frac{3}{4}", 0.75), ("50%", 0.5),
    ("$12", 12.0), ("12.", 12.0), (".5", 0.5), ("\\dfrac{1}{8}", 0.125),
    ("12,34", None), ("abc", None), ("1/0", None), ("", None), ("x = 3", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("completion,answer", [
    ("so the total is \\boxed{18}.", "18"),
    ("first \\boxed{3} then again \\boxed{3}", "3"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("She pays 5 + 3 = 8 dollars.\n#### 8", "8"),
    ("He has 3 apples and buys 4 more, so 7", "7"),
    ("The answer is 1,250 dollars.", "1,250"),
    ("no numbers here", None),
    ("\\boxed{3} or maybe \\boxed{4}", None),  # several different boxed answers: no answer
    ("\\boxed{3", None),  # unbalanced box: nothing committed
])
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


def test_math_accuracy_scores_and_drops():
    prompts = ["What is 2+3?"] * 6 + ["Q", "Q"]
    completions = [
        "2+3 = 5\n#### 5",            # right
        "\\boxed{5}",                  # right
        "I think it's 6.",             # wrong
        "\\boxed{5} \\boxed{6}",       # two different boxed answers: 0
        "What is 2+3?",                # an echo of the question: 0 (its last number is 3, not 5 here)
        "",                            # empty: 0
        "\\boxed{5}",                  # gold unparsable: None (dropped), not 0
        "5.0000000001",                # numeric equivalence within tolerance
    ]
    answers = ["#### 5"] * 6 + ["#### five", "5"]
    assert math_accuracy(prompts, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, None, 1.0]


def test_echo_of_a_question_that_contains_the_answer_scores_zero():
    prompt = "Tom had 5 apples and ate none. How many apples does Tom have? Answer: 5"
    assert math_accuracy([prompt], ["Tom had 5 apples and ate none."], answer=["#### 5"]) == [0.0]


def test_a_short_correct_answer_that_occurs_in_the_prompt_still_counts():
    assert math_accuracy(["Five is 5. What is 2+3?"], ["5"], answer=["#### 5"]) == [1.0]


def test_lengths_must_agree():
    with pytest.raises(ValueError):
        math_accuracy(["a", "b"], ["1"], answer=["#### 1", "#### 2"])


@pytest.mark.parametrize("completion,answer", [
    ("\\boxed{5}\n#### 5", "5"),                   # the same answer in two forms agrees
    ("\\boxed{5}\n#### 6", None),                  # a box and a #### line that disagree: no answer
    ("#### 5\n#### 6", None),                      # two different #### lines: no answer
    ("\\boxed{0.5} and \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # equal values written differently agree
])
def test_committed_answers_must_agree(completion, answer):
    assert extract_answer(completion) == answer


def test_several_different_boxed_answers_score_zero_and_identical_repeats_do_not():
    prompt = ["What is 2+3?"]
    assert math_accuracy(prompt, ["\\boxed{4} \\boxed{5} \\boxed{6}"], answer=["#### 5"]) == [0.0]
    assert math_accuracy(prompt, ["\\boxed{5} \\boxed{4}"], answer=["#### 5"]) == [0.0]  # the right one last
    assert math_accuracy(prompt, ["2+3 = 5, so \\boxed{5}. Again: \\boxed{5}"], answer=["#### 5"]) == [1.0]


def test_an_echo_repeated_or_with_filler_scores_zero():
    prompt = "Tom has 5 apples. He gives none away. How many apples does Tom have now?"
    for completion in [prompt + " " + prompt,                         # the question twice
                       "Question: " + prompt + "\nLet me think.",     # restated, no result of its own
                       prompt.upper()]:                               # case does not hide a copy
        assert math_accuracy([prompt], [completion], answer=["#### 5"]) == [0.0], completion


def test_a_solution_that_restates_the_question_still_counts():
    prompt = "Tom has 5 apples and buys 3 more. How many apples does Tom have now?"
    completion = "Tom has 5 apples and buys 3 more. 5 + 3 = 8.\n#### 8"
    assert math_accuracy([prompt], [completion], answer=["#### 8"]) == [1.0]


def test_strip_echo_blanks_only_copied_stretches():
    prompt = "Tom has 5 apples and buys 3 more."
    own, copied = strip_echo(prompt, "Tom has 5 apples, so 5 + 3 = 8")
    assert own.split() == ["so", "5", "+", "3", "=", "8"] and len(own) == len("Tom has 5 apples, so 5 + 3 = 8")
    assert copied == pytest.approx(4 / 10)
    assert strip_echo(prompt, "8") == ("8", 0.0)
    with pytest.raises(ValueError, match="min_words"):
        strip_echo(prompt, "8", min_words=0)


def test_registry_names_the_valid_names_and_the_nearest_one():
    from grpo_jax.rewards import REWARD_FUNCTIONS, code_reward, countdown_reward, format_reward, get_reward_fn

    assert get_reward_fn("math_accuracy") is math_accuracy
    assert get_reward_fn("format") is format_reward
    assert get_reward_fn("countdown") is countdown_reward
    assert get_reward_fn("code") is code_reward
    assert set(REWARD_FUNCTIONS) == {"math_accuracy", "format", "countdown", "code", "overlong", "reward_model",
                                     "llm_judge"}
    with pytest.raises(ValueError, match=r"'math_acuracy' \(did you mean 'math_accuracy'\?\); valid names: code, "
                                         r"countdown, format, llm_judge, math_accuracy, overlong, reward_model"):
        get_reward_fn("math_acuracy")
    with pytest.raises(ValueError, match="unknown reward function 'zzz'"):
        get_reward_fn("zzz")


def test_math_verify_judges_symbolic_answers():
    import math_verify  # noqa: F401  (in the test extra: this test must not skip)
    prompts = ["q"] * 5
    completions = ["so \\boxed{0.5}", "so \\boxed{\\frac{2}{4}}", "so \\boxed{x(x+2)}", "so \\boxed{x^2}",
                   "\\boxed{1/2} or \\boxed{3}"]
    gold = ["\\frac{1}{2}", "#### 1/2", "x^2+2x", "x^2+2x", "\\frac{1}{2}"]
    assert math_accuracy(prompts, completions, answer=gold, verifier="math_verify") == [1.0, 1.0, 1.0, 0.0, 0.0]
    # numeric can judge the numbers but not the polynomial gold answers (None = dropped, not 0)
    assert math_accuracy(prompts, completions, answer=gold) == [1.0, 1.0, None, None, 0.0]
    # auto: numbers numerically, the rest symbolically
    assert math_accuracy(prompts, completions, answer=gold, verifier="auto") == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_verify_missing_or_bad_verifier_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify":
            raise ImportError("not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(ImportError, match="pip install math-verify"):
        math_accuracy(["q"], ["1"], answer=["1"], verifier="math_verify")
    assert math_accuracy(["q"], ["\\boxed{x}"], answer=["x"], verifier="auto") == [None]
    with pytest.raises(ValueError, match="verifier='sympy'"):
        math_accuracy(["q"], ["1"], answer=["1"], verifier="sympy")
