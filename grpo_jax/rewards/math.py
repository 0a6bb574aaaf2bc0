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
_WORD = re.compile(r"\S+")
_EDGE_PUNCT = ".,;:!?\"'()[]"


def boxed_contents(text: str) -> list[str]:
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

    Committed answers are every `\\boxed{}` and every GSM8K `#### answer` line; they must all agree
    (by numeric value, or as text when not a number), else there is no answer: a completion that
    hedges between several different answers must not collect credit for whichever one is right.
    Identical repeats are fine. Only when nothing is committed does the last number in the text
    count. An unclosed `\\boxed{` is no answer.
    """
    if "\\boxed{" in completion and not boxed_contents(completion):
        return None  # an unclosed box: the completion tried to commit and failed
    committed = [b.strip() for b in boxed_contents(completion)] + [m.strip() for m in _GSM8K.findall(completion)]
    if committed:
        values = {parse_number(c) if parse_number(c) is not None else c for c in committed}
        return committed[-1] if len(values) == 1 else None
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def strip_echo(prompt: str, completion: str, *, min_words: int = 3) -> tuple[str, float]:
    """The completion with every stretch copied from the prompt blanked out, and the fraction of
    its words that were copied.

    A stretch is copied when `min_words` consecutive words (compared case-insensitively, without
    surrounding punctuation) also occur consecutively in the prompt. Only the model's own text can
    carry its answer: a completion that restates the question, whose numbers often include the
    answer, must not be credited for them, while a short answer that happens to be a number from
    the prompt ("5") still counts. Blanking keeps character offsets, so what remains can be parsed
    as usual. Paraphrases that change every few words are not caught; this is a guard against
    copying, not a plagiarism detector.
    """
    if min_words < 1:
        raise ValueError(f"min_words must be >= 1, got {min_words}")
    prompt_words = [w.strip(_EDGE_PUNCT).lower() for w in _WORD.findall(prompt)]
    spans = list(_WORD.finditer(completion))
    if not spans or not prompt_words:
        return completion, 0.0
    n = min(min_words, len(prompt_words))  # a prompt shorter than n words is copied by repeating it whole
    grams = {tuple(prompt_words[i:i + n]) for i in range(len(prompt_words) - n + 1)}
    words = [m.group().strip(_EDGE_PUNCT).lower() for m in spans]
    copied = [False] * len(words)
    for i in range(len(words) - n + 1):
        if tuple(words[i:i + n]) in grams:
            copied[i:i + n] = [True] * n
    chars = list(completion)
    for m, c in zip(spans, copied):
        if c:
            chars[m.start():m.end()] = " " * (m.end() - m.start())
    return "".join(chars), sum(copied) / len(copied)


def answers_match(predicted: str | None, gold: float, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    value = parse_number(predicted) if predicted is not None else None
    return value is not None and math.isclose(value, gold, rel_tol=rel_tol, abs_tol=abs_tol)


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("math_accuracy(verifier='math_verify') needs the math-verify package: "
                          "pip install math-verify (or use verifier='numeric' / 'auto')") from None
    return math_verify


def _gold_text(gold_field: str) -> str:
    m = _GSM8K.search(gold_field or "")
    if m:
        return m.group(1).strip()
    boxed = boxed_contents(gold_field or "")
    return (boxed[-1] if boxed else (gold_field or "")).strip()


def _symbolic_match(mv, predicted: str | None, gold_text: str) -> float | None:
    gold = mv.parse(f"${gold_text}$")
    if not gold:
        return None  # math-verify cannot read the gold answer either: unjudgeable
    return 1.0 if predicted is not None and mv.verify(gold, mv.parse(f"${predicted}$")) else 0.0


def math_accuracy(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[str],
                  verifier: str = "numeric", **_: object) -> list[float | None]:
    """1.0 if the completion's final answer equals the gold answer, 0.0 if not, None if the gold
    answer cannot be parsed. `answer` is the dataset's answer field (GSM8K style `... #### 42`, or
    a bare number / boxed expression).

    verifier: "numeric" compares numbers (fractions, percents, thousands separators) with a
    relative tolerance of 1e-6; "math_verify" compares the extracted answer with the gold one
    symbolically through the math-verify package (\\frac{1}{2} == 0.5, x^2+2x == x(x+2)); "auto"
    is numeric where the gold answer is a number and math-verify (if installed) otherwise.

    The answer is extracted from the completion's own text (`strip_echo`): stretches copied from
    the prompt are ignored, so echoing a question that contains the answer scores 0. Several
    different committed answers score 0 (`extract_answer`), whichever verifier judges.
    """
    if verifier not in ("numeric", "math_verify", "auto"):
        raise ValueError(f"math_accuracy: verifier={verifier!r} is not one of ['numeric', 'math_verify', 'auto']")
    mv = _math_verify() if verifier == "math_verify" else None
    if verifier == "auto":
        try:
            mv = _math_verify()
        except ImportError:
            mv = None
    out: list[float | None] = []
    for prompt, completion, gold_field in zip(prompts, completions, answer, strict=True):
        own_text, _ = strip_echo(prompt, completion)
        predicted = extract_answer(own_text)
        gold_text = _gold_text(gold_field)
        gold = parse_number(gold_text)
        if verifier == "math_verify" or (gold is None and mv is not None):
            out.append(_symbolic_match(mv, predicted, gold_text))
        elif gold is None:
            out.append(None)
        else:
            out.append(1.0 if answers_match(predicted, gold) else 0.0)
    return out
