"""Verifiable math answers: extraction (GSM8K `####`, `\\boxed{}`, last number) and numeric equivalence.

Reward functions follow the protocol `fn(prompts, completions, **example_fields) -> list[float | None]`:
one value per completion, None when the sample cannot be judged (e.g. an unparsable gold answer),
which drops it from the loss instead of teaching the model that it was wrong.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from fractions import Fraction

from grpo_jax.rewards.symbolic import DEFAULT_TIMEOUT_S, SymbolicJudge, load_math_verify

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*(.+)")
_WORD = re.compile(r"\S+")
_BRACE = re.compile(r"[{}]")
_EDGE_PUNCT = ".,;:!?\"'()[]"
# Minus signs and dashes read as '-': U+2212 minus, the hyphens and dashes U+2010-2015, the small
# and full-width hyphen-minus and em dash, the heavy minus sign.
_DASHES = str.maketrans(dict.fromkeys("\u2212\u2010\u2011\u2012\u2013\u2014\u2015\ufe58\ufe63\uff0d\u2796", "-"))
MAX_NUMBER_CHARS = 400  # a longer text is not read as a number (bounds the work on a completion's digits)
# What may not touch the last number of a completion for it to be read as one: an exponent or
# power before it (`4e3`, `4e+3`, `10^{3}`, `2**3`, `2 ** 3`; not markdown bold, `is **72**`), the
# denominator of a `\frac{1}{2}`, or a power after it (`5^2`, `2**x`, `10³`).
_BEFORE_NOT_A_NUMBER = re.compile(r"(?:\d[eE][+-]|\^\s*\{?\s*|(?:[\d)\]}]\s*|[A-Za-z_])\*\*\s*\(?\s*|\}\s*\{\s*|\d)$")
_AFTER_NOT_A_NUMBER = re.compile(r"\s*\^|\*\*[\w(]|\s+\*\*\s+[\w(]|[\u2070\u00b9\u00b2\u00b3\u2074-\u207b]")


def normalise_dashes(text: str) -> str:
    """`text` with every Unicode minus sign and dash replaced by '-' (same length: offsets keep)."""
    return text.translate(_DASHES)


def boxed_contents(text: str) -> list[str]:
    """Contents of every \\boxed{...} (nested braces allowed), in order; the boxes up to the first
    one left open. One pass over the braces."""
    out, start = [], 0
    while (i := text.find("\\boxed{", start)) != -1:
        depth, end = 1, -1
        for brace in _BRACE.finditer(text, i + len("\\boxed{")):
            depth += 1 if brace.group() == "{" else -1
            if not depth:
                end = brace.start()
                break
        if end == -1:
            break  # unbalanced: no answer
        out.append(text[i + len("\\boxed{"):end])
        start = end + 1
    return out


def parse_exact(text: str) -> Fraction | None:
    """The exact value of a number written as 1,234 / -3.5 / 3/4 / \\frac{3}{4} / 50% / $12 (any
    Unicode minus or dash as '-'), or None: not a number, a comma that is not a thousands separator
    (`12,34`, `1,2,3`), a zero denominator, or a text longer than MAX_NUMBER_CHARS."""
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
        return None
    t = normalise_dashes(text).strip().replace("$", "").replace("\\!", "").replace("\\,", "")
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
    return value / 100 if percent else value


def parse_number(text: str) -> float | None:
    """`parse_exact` as a float; None also for a number beyond float range (10**309)."""
    value = parse_exact(text)
    try:
        return None if value is None else float(value)
    except OverflowError:
        return None


def extract_answer(completion: str) -> str | None:
    """The final answer a completion commits to, or None.

    Committed answers are every `\\boxed{}` and every GSM8K `#### answer` line; they must all agree
    (by exact value, or as text when not a number), else there is no answer: a completion that
    hedges between several different answers must not collect credit for whichever one is right.
    Identical repeats are fine. Only when nothing is committed does the last number in the text
    count (`last_number`). An unclosed `\\boxed{` is no answer. Unicode minus signs and dashes
    read as '-'.
    """
    completion = normalise_dashes(completion)
    boxed = boxed_contents(completion)
    if "\\boxed{" in completion and not boxed:
        return None  # an unclosed box: the completion tried to commit and failed
    committed = [b.strip() for b in boxed] + [m.strip() for m in _GSM8K.findall(completion)]
    if committed:
        values = {value if (value := parse_exact(c)) is not None else c for c in committed}
        return committed[-1] if len(values) == 1 else None
    return last_number(completion)


def last_number(text: str) -> str | None:
    """The last number written in `text`, or None when there is none or the last one is part of
    something else: a name or a unit glued to it (`x5`, `a_2`, `5x`, `12kg`; a letter with case,
    so `答案是5` still reads 5), an exponent (`4e3`, `4e-3`, `10^{3}`, `2**3`, `10³`), or a power
    (`5^2`). Reading the mantissa or the exponent alone would credit a number the text does not
    state; an earlier number is not read instead either, since it is not the final one."""
    last = None
    for last in _NUMBER.finditer(text):
        pass
    if last is None:
        return None
    before, after = text[max(0, last.start() - 8):last.start()], text[last.end():last.end() + 8]
    if _BEFORE_NOT_A_NUMBER.search(before) or _AFTER_NOT_A_NUMBER.match(after):
        return None
    if (before and _cased_or_underscore(before[-1])) or (after and _cased_or_underscore(after[0])):
        return None
    return last.group()


def _cased_or_underscore(ch: str) -> bool:
    return ch == "_" or ch.isupper() or ch.islower()


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


def answers_match(predicted: str | None, gold: Fraction | float, *, rel_tol: float = 1e-6,
                  abs_tol: float = 1e-9) -> bool:
    """Whether the answer text `predicted` states the number `gold`.

    Exact (Fraction) equality when `gold` is an integer or a terminating decimal: 1234568 is not
    1234567, and 5.0000000001 is not 5. Only a gold answer whose decimal expansion never ends (1/3,
    2/7) can be met approximately, and only by a terminating value (a rounded decimal such as
    0.333333, six significant digits for the default `rel_tol`) within `rel_tol` of it (relative)
    or `abs_tol` (absolute); a fraction must equal it exactly. A float `gold` is taken as the
    decimal it prints as (0.1 is 1/10)."""
    value = parse_exact(predicted) if isinstance(predicted, str) else None
    gold = _as_fraction(gold)
    if value is None or gold is None:
        return False
    if value == gold:
        return True
    if _terminates(gold) or not _terminates(value):
        return False
    tolerance = max(Fraction(str(rel_tol)) * max(abs(value), abs(gold)), Fraction(str(abs_tol)))
    return abs(value - gold) <= tolerance


def _as_fraction(value: object) -> Fraction | None:
    if isinstance(value, Fraction):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return Fraction(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return Fraction(repr(float(value)))
        except (ValueError, OverflowError):  # nan, inf
            return None
    return None


def _terminates(value: Fraction) -> bool:
    """Whether the decimal expansion of `value` ends (its denominator has no prime but 2 and 5)."""
    d = value.denominator
    d >>= (d & -d).bit_length() - 1  # the factors of 2
    while d % 5 == 0:
        d //= 5
    return d == 1


def _gold(field: object) -> tuple[str | None, Fraction | None]:
    """(the gold answer's text, its exact value when it is a number) from a dataset's answer field:
    text (GSM8K `... #### 42`, a boxed expression, a bare answer) or a number. (None, None) when the
    field is neither: the sample cannot be judged."""
    if isinstance(field, numbers.Real) and not isinstance(field, bool):
        value = _as_fraction(field)
        if value is None:
            return None, None
        return (str(int(field)) if isinstance(field, numbers.Integral) else repr(float(field))), value
    if not isinstance(field, str):
        return None, None
    field = normalise_dashes(field)
    m = _GSM8K.search(field)
    boxed = [] if m else boxed_contents(field)
    text = (m.group(1) if m else boxed[-1] if boxed else field).strip()
    return text, parse_exact(text)


def math_accuracy(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[str],
                  verifier: str = "numeric", verify_timeout_s: float = DEFAULT_TIMEOUT_S,
                  **_: object) -> list[float | None]:
    """1.0 if the completion's final answer equals the gold answer, 0.0 if not, None if the gold
    answer cannot be parsed. `answer` is the dataset's answer field (GSM8K style `... #### 42`, a
    bare number / boxed expression, or a number).

    verifier: "numeric" compares numbers (fractions, percents, thousands separators) exactly
    where the gold answer is an integer or a terminating decimal, and within a relative 1e-6 only
    where it is not (1/3 accepts 0.333333; `answers_match`); "math_verify" compares the extracted
    answer with the gold one symbolically through the math-verify package (\\frac{1}{2} == 0.5,
    x^2+2x == x(x+2)), except that two plain numbers are compared as "numeric" does; "auto" is
    numeric where the gold answer is a number and math-verify (if installed) otherwise.
    math-verify runs under limits (grpo_jax.rewards.symbolic): an answer over 200 characters or
    nested too deeply (`9^{9^{9^{9}}}`) scores 0 unparsed, and parsing plus comparing one answer
    gets `verify_timeout_s` seconds (then 0; a gold answer out of time: None).

    The answer is extracted from the completion's own text (`strip_echo`): stretches copied from
    the prompt are ignored, so echoing a question that contains the answer scores 0. Several
    different committed answers score 0 (`extract_answer`), whichever verifier judges. No
    completion text makes this raise: a number too long to be one (`MAX_NUMBER_CHARS`) is no
    answer, and a 400-digit one is compared exactly like any other.
    """
    if verifier not in ("numeric", "math_verify", "auto"):
        raise ValueError(f"math_accuracy: verifier={verifier!r} is not one of ['numeric', 'math_verify', 'auto']")
    if not (isinstance(verify_timeout_s, (int, float)) and verify_timeout_s > 0):
        raise ValueError(f"math_accuracy: verify_timeout_s must be a number of seconds > 0, got {verify_timeout_s!r}")
    judge = _symbolic_judge(verifier, verify_timeout_s)
    return [_score(prompt, completion, gold_field, verifier, judge)
            for prompt, completion, gold_field in zip(prompts, completions, answer, strict=True)]


def _symbolic_judge(verifier: str, timeout_s: float) -> SymbolicJudge | None:
    if verifier == "numeric":
        return None
    try:
        return SymbolicJudge(load_math_verify(), timeout_s)
    except ImportError:
        if verifier == "math_verify":
            raise
        return None  # auto without math-verify: the gold answers that are not numbers go unjudged


def _score(prompt: str, completion: str, gold_field: object, verifier: str,
           judge: SymbolicJudge | None) -> float | None:
    gold_text, gold = _gold(gold_field)
    if gold_text is None:
        return None
    own_text, _ = strip_echo(prompt, completion)
    predicted = extract_answer(own_text)
    if gold is not None and (verifier != "math_verify" or parse_exact(predicted) is not None):
        return 1.0 if answers_match(predicted, gold) else 0.0
    if judge is None:
        return None  # not a number, and no symbolic verifier
    return judge(predicted, gold_text)
