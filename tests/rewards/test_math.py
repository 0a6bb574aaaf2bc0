"""Math answer extraction and the accuracy reward, including answers that must score 0."""

from __future__ import annotations

import signal
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

from grpo_jax.rewards.combine import RewardSpec, combine_rewards
from grpo_jax.rewards.math import (answers_match, extract_answer, last_number, math_accuracy, parse_exact,
                                   parse_number, strip_echo)
from grpo_jax.rewards.symbolic import too_complex


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
    prompts = ["What is 2+3?"] * 6 + ["Q", "Q", "Q"]
    completions = [
        "2+3 = 5\n#### 5",            # right
        "\\boxed{5}",                  # right
        "I think it's 6.",             # wrong
        "\\boxed{5} \\boxed{6}",       # two different boxed answers: 0
        "What is 2+3?",                # an echo of the question: 0 (its last number is 3, not 5 here)
        "",                            # empty: 0
        "\\boxed{5}",                  # gold unparsable: None (dropped), not 0
        "5.0000000001",                # an integer gold is compared exactly (this was 1.0 under rel_tol=1e-6)
        "5.000",                       # the same number written with decimals
    ]
    answers = ["#### 5"] * 6 + ["#### five", "5", "5"]
    assert math_accuracy(prompts, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, None, 0.0, 1.0]


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


# --- issue 25: exact numbers, dashes, the last-number fallback, bounded math-verify -------------

BIG = "1" + "0" * 320  # beyond float range: float(Fraction(BIG)) raises OverflowError


def score(completion, gold, **kwargs):
    return math_accuracy(["q"], [completion], answer=[gold], **kwargs)[0]


def test_a_number_beyond_float_range_costs_its_own_sample_only():
    assert math_accuracy(["q"] * 3, ["\\boxed{5}", "\\boxed{6}", f"\\boxed{{{BIG}}}"], answer=["5"] * 3) == [1.0, 0.0, 0.0]
    assert score(BIG, BIG) == 1.0 and score(BIG + "1", BIG) == 0.0  # compared exactly, not as floats
    assert score(f"\\boxed{{{BIG}}}", BIG[:-1] + "1") == 0.0
    assert parse_number(BIG) is None and parse_exact(BIG) == 10 ** 320
    assert parse_exact("9" * 401) is None and score("9" * 401, "9" * 400) == 0.0  # too long to read


@pytest.mark.parametrize("wrong,right,gold", [
    ("1234568", "1234567", "#### 1234567"),         # was 1.0 under rel_tol=1e-6
    ("\\boxed{1,234,568}", "\\boxed{1,234,567}", "1,234,567"),
    ("5.0000000001", "5.0", "5"),
    ("12.5000001", "25/2", "12.5"),
    ("0.1000001", "\\boxed{\\frac{1}{10}}", "0.1"),
    ("1000000001", "1000000000", "1000000000"),
    ("0.5001", "\\boxed{50\\%}", "0.5"),
])
def test_integers_and_terminating_decimals_are_compared_exactly(wrong, right, gold):
    assert score(wrong, gold) == 0.0
    assert score(right, gold) == 1.0


def test_the_tolerance_is_only_for_gold_answers_that_are_not_exact():
    gold = "\\frac{1}{3}"
    assert [score(c, gold) for c in ["1/3", "2/6", "0.333333", "0.3333333333"]] == [1.0] * 4
    assert [score(c, gold) for c in ["0.3333", "0.33", "0.334", "1000000/3000001"]] == [0.0] * 4
    assert answers_match("0.666667", Fraction(2, 3)) and not answers_match("0.6667", Fraction(2, 3))
    assert answers_match("0.1", 0.1) and not answers_match("0.1000001", 0.1)  # a float gold: the decimal it prints


@pytest.mark.parametrize("dash", ["\u2212", "\u2013", "\u2014", "\u2012", "\ufe63", "\uff0d"])
def test_unicode_minus_and_dashes_are_minus(dash):
    assert score(f"so {dash}5", "5") == 0.0          # was read as 5
    assert score(f"so {dash}5", "-5") == 1.0
    assert score(f"\\boxed{{{dash}5}}", "#### -5") == 1.0
    assert score("so -5", f"{dash}5") == 1.0          # the gold answer is normalised too
    assert score("so 5", "5") == 1.0


@pytest.mark.parametrize("wrong,gold", [
    ("it is 4e3", "3"), ("it is 4e3", "4"), ("it is 4E+3", "3"), ("it is 4e-3", "-3"), ("x5", "5"),
    ("so a_5", "5"), ("then 5x", "5"), ("about 12kg", "12"), ("4 \\times 10^{3}", "3"), ("2**3", "3"),
    ("2 ** 3", "3"), ("5^2", "5"), ("10³", "10"), ("\\frac{1}{2}", "2"), ("version 1.2.3", "3"),
])
def test_the_last_number_is_not_read_out_of_a_name_a_unit_or_an_exponent(wrong, gold):
    assert score(wrong, gold) == 0.0


@pytest.mark.parametrize("completion,number", [
    ("x = 5", "5"), ("The answer is **72**.", "72"), ("**72** and that is all", "72"), ("48+24=72", "72"),
    ("答案是5", "5"), ("($12)", "12"), ("It is 72!", "72"), ("4e3", None), ("x5", None),
])
def test_last_number_controls(completion, number):
    assert last_number(completion) == number
    if number is not None:
        assert score(completion, number) == 1.0


def test_odd_samples_score_without_raising_and_leave_the_others_alone():
    completions = ["\\boxed{5}", f"\\boxed{{{BIG}}}", "\x00" * 100 + "\ud800", "\\boxed{" * 10_000, "5" * 5000,
                   "\\boxed{5}\n#### \u221e", "\\boxed{6}", "so 5"]
    assert math_accuracy(["q"] * 8, completions, answer=["5"] * 8) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_odd_gold_fields_are_unjudged_not_errors():
    gold = [5, 5.0, np.int64(5), "#### 5", None, float("nan"), True, ["5"]]
    assert math_accuracy(["q"] * 8, ["\\boxed{5}"] * 8, answer=gold) == [1.0, 1.0, 1.0, 1.0, None, None, None, None]
    assert math_accuracy(["q"], ["0.25"], answer=[0.25]) == [1.0]


def test_a_poisoned_sample_among_good_ones_through_combine_rewards():
    specs = [RewardSpec("math_accuracy", math_accuracy)]
    completions = ["\\boxed{5}", None, "\\boxed{6}", f"\\boxed{{{BIG}}}", "so 5"]  # None: raises in strip_echo
    result = combine_rewards(specs, ["q"] * 5, completions, {"answer": ["5"] * 5})
    np.testing.assert_array_equal(result.per_fn["math_accuracy"], [1.0, np.nan, 0.0, 0.0, 1.0])
    assert result.failures == {"math_accuracy": 1} and "(sample 1)" in result.messages["math_accuracy"]


def test_math_verify_limits_answer_size_and_nesting():
    assert too_complex("9^{9^{9^{9}}}") and too_complex("x" * 201) and too_complex("((((((1))))))")
    assert too_complex("e^{-x^2}") is None and too_complex("\\frac{\\sqrt{x^{2}+1}}{2}") is None
    with pytest.raises(ValueError, match="verify_timeout_s"):
        math_accuracy(["q"], ["1"], answer=["1"], verifier="math_verify", verify_timeout_s=0)


def elapsed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@pytest.mark.parametrize("slow,gold", [
    ("\\boxed{9^{9^{9^{9}}}}", "5"),       # rejected before SymPy sees it (5.5-7 s per sample before)
    ("\\boxed{9^{999999999}}", "5"),       # stopped by the time limit
    ("\\boxed{(10^{100})!}", "x^2+2x"),
])
def test_math_verify_slow_answers_score_zero_within_a_second(slow, gold):
    math_accuracy(["q"], ["\\boxed{1}"], answer=["1"], verifier="math_verify")  # math-verify imported and warm
    before = signal.getsignal(signal.SIGALRM)
    scores, seconds = elapsed(lambda: math_accuracy(["q"] * 2, [slow, "\\boxed{x(x+2)}" if "x" in gold else "\\boxed{5}"],
                                                    answer=[gold] * 2, verifier="math_verify"))
    assert scores == [0.0, 1.0]
    assert seconds < 2.0, seconds  # the limit is 0.5 s a sample; 2 s is a generous bound on a busy machine
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_math_verify_refuses_to_run_without_its_time_limit_outside_the_main_thread():
    math_accuracy(["q"], ["\\boxed{1}"], answer=["1"], verifier="math_verify")
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raised(
        lambda: math_accuracy(["q"], ["\\boxed{x}"], answer=["x"], verifier="math_verify"))))
    thread.start()
    thread.join()
    assert isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0])
    assert math_accuracy(["q"], ["\\boxed{5}"], answer=["5"], verifier="auto") == [1.0]  # numbers need no SymPy


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None
