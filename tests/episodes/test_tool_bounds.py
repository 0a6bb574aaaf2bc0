"""The built-in tools under a model's attack (issue 44, item 1): the calculator bounds the size of
an exact value before computing it, a JSON tool call that breaks Python's parser (brackets nested
past the recursion limit, an integer past 4,300 digits) is the episode's tool error, and the
search for a tool call's closing tag at a turn's end does work linear in the turn's length."""

from __future__ import annotations

import math
import time
from fractions import Fraction

import numpy as np
import pytest

from grpo_jax.data.tokenizer import char_tokenizer
from grpo_jax.env.calculator import Calculator, CalculatorError, calculate, format_value
from grpo_jax.episodes.episode import Episode, EpisodeLimits
from grpo_jax.episodes.host import TagSearch

HERMES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOK = char_tokenizer(add_bos=True, chat_template=HERMES)


def test_a_power_too_large_to_hold_exactly_is_rounded_before_it_is_computed():
    # Near e, so under every magnitude limit, but its exact fraction would take 7 * 10^8 digits:
    # one uninterruptible Fraction power holding the GIL for hours before sizes were bounded. Such a
    # power is computed to 140 significant digits instead (decided before computing it).
    start = time.monotonic()
    rounded = {"(1.0000001**10000)**10000": math.exp(10000 * 10000 * math.log1p(1e-7)),
               "1.0000001**10000": 1.0000001 ** 10000, "(1 + 0.05/365) ** 3650": (1 + 0.05 / 365) ** 3650,
               "(1 + 1/10000) ** 10000": (1 + 1e-4) ** 10000}
    for expression, approx in rounded.items():
        assert float(calculate(expression)) == pytest.approx(approx, rel=1e-9), expression
    assert time.monotonic() - start < 1.0  # milliseconds; exact, the first alone never returns
    answer = Calculator().step("<calculator>(1.0000001**10000)**10000</calculator>").messages[0]["content"]
    assert answer == "22026.4547815773"
    with pytest.raises(CalculatorError, match="more than 100 digits"):  # magnitudes stay bounded
        calculate("((1.0001**9999)**9999)**9999")
    # Ordinary arithmetic stays exact, including powers whose exact value is long.
    assert calculate("0.1 + 0.2") == "0.3" and calculate("2 ** 64 + 1") == "18446744073709551617"
    assert calculate("(1 + 0.05/12) ** 360") == format_value(Fraction(241, 240) ** 360) == "4.467744314"
    assert calculate("1.0000001 ** 1000 * 3") == format_value(Fraction("1.0000001") ** 1000 * 3)


DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "1" * 4301


@pytest.mark.parametrize("call, error", [
    (DEEP, "nests brackets too deeply"),
    ('{"name": "calculator", "arguments": {"expression": "1 + 1"}, "id": ' + HUGE + "}", "4300 digits"),
    ('{"name": "calculator", "arguments": {"expression": ' + DEEP + "}}", "nests brackets too deeply"),
    ('{"name": "calculator", "arguments": "{\\"expression\\": ' + HUGE + '}"}', "takes {\"expression\": <string>}"),
    ('{"name": ' + "[" * 200 + "]" * 200 + "}", "unknown tool a JSON list"),
])
def test_json_arguments_that_break_the_parser_are_the_episodes_tool_error(call, error):
    """Each attack is answered as a botched call (a tool message the model reads), the episode goes
    on to its next turn, and its batch-mate's call is answered as usual."""
    make = lambda: Calculator(tool_format="json")  # noqa: E731
    limits = EpisodeLimits(max_model_tokens=400_000, max_env_tokens=200)
    attacked, mate = (Episode(make, {"prompt": "What is 6 * 7?"}, TOK, limits) for _ in range(2))
    answers = []
    for ep, text in [(attacked, call), (mate, '{"name": "calculator", "arguments": {"expression": "6 * 7"}}')]:
        ep.open()
        sampled = TOK(f"<tool_call>{text}</tool_call>", add_special_tokens=False)["input_ids"]
        fed = ep.respond(ep.add_turn(sampled, [0.0] * len(sampled), stopped=False))
        assert fed is not None and ep.error is None and not ep.done
        answers.append(ep.history[-1]["content"])
    assert answers[0].startswith("error: ") and error in answers[0], answers[0]
    assert answers[1] == "42"


def tag_search_work(n: int, tag: str = "</tool_call>", every: int = 16) -> tuple[int, int]:
    """A turn of `n` tokens that ends with `tag` (then tokens the model drew past it), searched as
    the host does after each segment of `every` tokens -> (where the search put the turn's end,
    the token ids it decoded)."""
    text = ("x = 12 * 7 " * n)[:n - len(tag)] + tag + " and more"
    tokens = np.asarray(TOK(text, add_special_tokens=False)["input_ids"])
    search, end, t = TagSearch(TOK, tag), None, 0
    while end is None:
        t = min(len(tokens), t + every)
        end = search.end(tokens, 0, t)
    return end, search.decoded


def test_the_tool_tag_search_does_work_linear_in_the_turns_length():
    """The work counted (token ids decoded), not timed: 8 times the turn is about 8 times the work
    (a search that decodes the turn at every poll, or each prefix at the end, does 64 times)."""
    (end, small), (end8, large) = tag_search_work(512), tag_search_work(8 * 512)
    assert (end, end8) == (512, 8 * 512)
    assert large < 12 * small and large < 8 * (8 * 512), (small, large)


@pytest.mark.parametrize("every", [1, 5, 64])
def test_the_tool_tag_search_finds_the_fewest_tokens_holding_the_tag(every):
    """Against the definition (the shortest prefix of the turn whose text holds the tag), for a
    tag anywhere, written across polls, or absent; a new start is a new turn."""
    tag, rng = "</calculator>", np.random.default_rng(every)
    search = TagSearch(TOK, tag)
    for trial in range(12):
        text = "".join(rng.choice(list("<>/ calcutor12\n"), size=int(rng.integers(0, 80))))
        at = int(rng.integers(0, len(text) + 1))
        text = text[:at] + (tag if trial % 4 else "") + text[at:]
        start = trial * 3  # tokens of earlier turns before this one's
        tokens = np.asarray([7] * start + TOK(text, add_special_tokens=False)["input_ids"])
        expected = next((start + k for k in range(1, len(tokens) - start + 1)
                         if tag in TOK.decode(tokens[start:start + k].tolist(), skip_special_tokens=False)), None)
        found, t = None, start
        while found is None and t < len(tokens):
            t = min(len(tokens), t + every)
            found = search.end(tokens, start, t)
        assert found == expected, (text, found, expected)
