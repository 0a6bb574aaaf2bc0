"""Verifiable math answers: extraction (GSM8K `####`, `\\boxed{}`, last number) and numeric equivalence.

Reward functions follow the protocol `fn(prompts, completions, **example_fields) -> list[float | None]`:
one value per completion, None when the sample cannot be judged (e.g. an unparsable gold answer),
which drops it from the loss instead of teaching the model that it was wrong.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*(.+)")


def _boxed_contents(text: str) -> list[str]:
    """Contents of every \\boxed{...} (nested braces allowed), in order."""
    out, start = [], 0
    while (i := text.find("\\boxed{", start)) != -1:
        depth, j = 1, i + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:
            break  # unbalanced: no answer
        out.append(text[i + len("\\boxed{"):j - 1])
        start = j
    return out


def parse_number(text: str) -> float | None:
    """A number written as 1,234 / -3.5 / 3/4 / \\frac{3}{4} / 50% / $12, or None."""
    t = text.strip().replace("$", "").replace("\\!", "").replace("\\,", "")
    t = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", t)
    t = t.rstrip(".").strip()
    percent = t.endswith("%") or t.endswith("\\%")
    t = t.rstrip("%").rstrip("\\").strip()
    m = re.fullmatch(r"(-?)\s*(\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*(\d+))?", t)
    if not m:
        return None
    sign, num, den = m.groups()
    if "," in num and not re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", num):
        return None
    try:
        value = Fraction(num.replace(",", ""))
        if den is not None:
            if int(den) == 0:
                return None
            value /= int(den)
    except (ValueError, ZeroDivisionError):
        return None
    value = -value if sign else value
    return float(value / 100 if percent else value)


def extract_answer(completion: str) -> str | None:
    """The final answer a completion commits to, or None.

    Order: `\\boxed{}` (all boxes must agree: several different boxed answers are no answer),
    then a GSM8K `#### answer` line, then the last number in the text. An unclosed `\\boxed{` is
    no answer.
    """
    boxes = [b.strip() for b in _boxed_contents(completion)]
    if "\\boxed{" in completion and not boxes:
        return None  # an unclosed box: the completion tried to commit and failed
    if boxes:
        values = {parse_number(b) if parse_number(b) is not None else b for b in boxes}
        return boxes[-1] if len(values) == 1 else None
    m = _GSM8K.search(completion)
    if m:
        return m.group(1).strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def gsm8k_gold(answer_field: str) -> float | None:
    """The number after `####` in a GSM8K answer field (None if absent or unparsable)."""
    m = _GSM8K.search(answer_field or "")
    return parse_number(m.group(1)) if m else None


def answers_match(predicted: str | None, gold: float, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    value = parse_number(predicted) if predicted is not None else None
    return value is not None and math.isclose(value, gold, rel_tol=rel_tol, abs_tol=abs_tol)


def math_accuracy(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[str],
                  **_: object) -> list[float | None]:
    """1.0 if the completion's final answer equals the gold number, 0.0 if not, None if the gold
    answer cannot be parsed. `answer` is the dataset's answer field (GSM8K style `... #### 42`, or
    a bare number / boxed expression)."""
    out: list[float | None] = []
    for prompt, completion, gold_field in zip(prompts, completions, answer, strict=True):
        gold = gsm8k_gold(gold_field)
        if gold is None:
            boxed = _boxed_contents(gold_field or "")
            gold = parse_number(boxed[-1] if boxed else (gold_field or ""))
        if gold is None:
            out.append(None)
            continue
        predicted = extract_answer(completion)
        # An echo of the question (a multi-word stretch of the prompt, copied) is no answer: the last
        # number of a restated question is not a result. A bare "5" that happens to occur in the
        # prompt is still judged as an answer.
        echoed = completion.strip()
        if len(echoed.split()) >= 3 and echoed in prompt:
            out.append(0.0)
            continue
        out.append(1.0 if answers_match(predicted, gold) else 0.0)
    return out
