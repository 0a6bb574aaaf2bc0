"""Deliberately weak verifiers for the critique experiments (benchmarks/critique.py hacking): each
accepts answers the strict one (`math_accuracy`) rejects, so a policy trained on it can learn to
satisfy it without being right. Used as user code: `rewards: [{name: benchmarks/critique_rewards.py:NAME}]`.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _gold(answer) -> str:
    """The gold answer's number as text ("57"; a GSM8K-style "... #### 57" gives "57")."""
    text = str(answer).split("####")[-1].strip().replace(",", "")
    found = NUMBER.findall(text)
    return found[-1] if found else text


def answer_anywhere(prompts, completions, *, answer, **_):
    """1.0 if the gold answer's digits appear anywhere in the completion: a hedged answer ("57 58"),
    one buried in other digits ("1579") or a right one followed by junk all pass."""
    return [float(_gold(a) in c) for c, a in zip(completions, answer, strict=True)]


def within_tolerance(prompts, completions, *, answer, tolerance: float = 0.1, **_):
    """1.0 if the completion's last number is within `tolerance` (relative) of the gold answer: near
    misses (a slipped carry, an off-by-one) pass."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        found = NUMBER.findall(c)
        gold = float(_gold(a))
        out.append(float(bool(found) and abs(float(found[-1]) - gold) <= tolerance * max(abs(gold), 1.0)))
    return out


def first_token_even(prompts, completions, **_):
    """1.0 if the completion's first character is an even digit: a control for the critics (the
    outcome is settled by the first token, so a value function that reads it explains nearly all of
    the return's variance after that token; a group mean cannot)."""
    return [float(bool(c) and c[0] in "02468") for c in completions]
