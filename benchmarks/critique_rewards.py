"""Deliberately weak verifiers for the critique experiments (benchmarks/critique.py hacking): each
accepts answers the strict one (`math_accuracy`) rejects, so a policy trained on it can learn to
satisfy it without being right. Used as user code: `rewards: [{name: benchmarks/critique_rewards.py:NAME}]`.
"""

from __future__ import annotations

import json
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


CHAIN = re.compile(r"(\d(?:[+-]\d)+)=\s*$")


def gold_derivation(prompt: str) -> str:
    """The chain task's gold answer in full: "8-7+8+7=" -> "1 9 16", the running totals after each
    operation (the question is the prompt's last line)."""
    found = CHAIN.search(prompt)
    if found is None:
        raise ValueError(f"not an arithmetic chain: {prompt[-40:]!r}")
    body = found.group(1)
    total, totals = int(body[0]), []
    for i in range(1, len(body), 2):
        total = total + int(body[i + 1]) if body[i] == "+" else total - int(body[i + 1])
        totals.append(total)
    return " ".join(map(str, totals))


def derivation_exact(prompts, completions, **_):
    """1.0 if every running total of the chain's derivation is right (a verifier that checks each
    step, not only the last number): the first slip settles the outcome, so a value function that
    sees it can assign the credit to that token and a group's mean cannot."""
    return [float(c.strip() == gold_derivation(p)) for p, c in zip(prompts, completions, strict=True)]


def logged(prompts, completions, *, log: str, reward: str = "answer", **kwargs):
    """The chain task's reward (`answer`: math_accuracy on the last total; `derivation`:
    derivation_exact), every row appended to the JSONL file `log` as it is scored (a group's rows
    together): benchmarks/credit_oracle.py reads all rows of every group (a run's samples.jsonl
    keeps one per group)."""
    from grpo_jax.rewards import math_accuracy

    scores = (derivation_exact(prompts, completions) if reward == "derivation"
              else math_accuracy(prompts, completions, **kwargs))
    with open(log, "a", encoding="utf-8") as f:
        for p, c, s in zip(prompts, completions, scores, strict=True):
            f.write(json.dumps({"prompt": p, "completion": c, "reward": s}) + "\n")
    return scores
