"""Format reward: the completion shows its reasoning, then commits to exactly one final answer.

Pairs with an accuracy reward: accuracy says whether the answer is right, this says whether the
completion is shaped the way the task asks (reasoning first, one answer at the end, in the expected
form). It is judged on the completion's own text (`strip_echo`): a completion that copies the
question is not reasoning, however long it is.

Answer styles (`answer_style`):
  "boxed"  `\\boxed{...}` (nested braces allowed)
  "gsm8k"  a line `#### ...`
  "tag"    `<answer>...</answer>` (tag name set by `answer_tag`)
With `reasoning_tag="think"`, the reasoning must also sit in one `<think>...</think>` block
before the answer (DeepSeek-R1 style prompts).

Every completion can be judged, so this never returns None.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from grpo_jax.rewards.math import boxed_contents, strip_echo

AnswerStyle = Literal["boxed", "gsm8k", "tag"]
ANSWER_STYLES: tuple[str, ...] = ("boxed", "gsm8k", "tag")
_TAG_NAME = re.compile(r"[A-Za-z][\w-]*")


def _answer_spans(text: str, style: str, tag: str) -> list[tuple[int, int, str]] | None:
    """(start, end, content) of every answer marker of `style` in `text`; None if a marker is left
    open (the completion tried to commit and failed, e.g. it was truncated)."""
    if style == "boxed":
        contents = boxed_contents(text)
        starts = [m.start() for m in re.finditer(re.escape("\\boxed{"), text)]
        if len(contents) != len(starts):
            return None
        return [(s, s + len("\\boxed{") + len(c) + 1, c) for s, c in zip(starts, contents)]
    if style == "gsm8k":
        if text.count("####") != len(re.findall(r"(?m)^[ \t]*####", text)):
            return None  # a #### in mid-line: not the committed form, and a second answer if counted
        return [(m.start(), m.end(), m.group(1)) for m in re.finditer(r"(?m)^[ \t]*####[ \t]*(.*)$", text)]
    opening, closing = f"<{tag}>", f"</{tag}>"
    if text.count(opening) != text.count(closing):
        return None
    spans = [(m.start(), m.end(), m.group(1)) for m in re.finditer(f"{re.escape(opening)}(.*?){re.escape(closing)}", text, re.S)]
    return spans if len(spans) == text.count(opening) else None


def _reasoning(text: str, answer_start: int, reasoning_tag: str | None) -> str | None:
    """The reasoning before the answer, or None when a required reasoning block is missing."""
    before = text[:answer_start]
    if reasoning_tag is None:
        return before
    opening, closing = f"<{reasoning_tag}>", f"</{reasoning_tag}>"
    if text.count(opening) != 1 or text.count(closing) != 1:
        return None
    m = re.search(f"{re.escape(opening)}(.*?){re.escape(closing)}", before, re.S)
    return m.group(1) if m else None


def format_reward(prompts: Sequence[str], completions: Sequence[str], *, answer_style: AnswerStyle = "boxed",
                  answer_tag: str = "answer", reasoning_tag: str | None = None, require_reasoning: bool = True,
                  min_reasoning_chars: int = 20, answer_pattern: str | None = None, max_trailing_chars: int = 20,
                  max_echo_fraction: float = 0.5, **_: object) -> list[float | None]:
    """1.0 for a well-formed completion, else 0.0.

    Well-formed means, on the completion's own text (copies of the prompt blanked out):
    - exactly one answer marker of `answer_style`, not left open, with non-empty content that
      fully matches `answer_pattern` when given (e.g. `r"-?[\\d,]+"` for an integer answer). Two
      markers are two final answers, even when they agree: the form asks for one.
    - at most `max_trailing_chars` characters after the answer (room for a closing "." or "$"):
      the answer is the end of the completion, not something buried in the middle of it.
    - when `require_reasoning`, at least `min_reasoning_chars` non-space characters of reasoning
      before the answer (inside the `reasoning_tag` block when one is set); so a bare number, or
      "The answer is \\boxed{5}", is not reasoning.
    - at most `max_echo_fraction` of the completion's words copied from the prompt.
    """
    if answer_style not in ANSWER_STYLES:
        raise ValueError(f"answer_style must be one of {ANSWER_STYLES}, got {answer_style!r}")
    for name, tag in (("answer_tag", answer_tag), ("reasoning_tag", reasoning_tag)):
        if tag is not None and not _TAG_NAME.fullmatch(tag):
            raise ValueError(f"{name} must be a bare tag name such as 'answer' or 'think' (no brackets), got {tag!r}")
    if min_reasoning_chars < 0 or max_trailing_chars < 0:
        raise ValueError(f"min_reasoning_chars and max_trailing_chars must be >= 0, got "
                         f"{min_reasoning_chars} and {max_trailing_chars}")
    if not 0.0 <= max_echo_fraction <= 1.0:
        raise ValueError(f"max_echo_fraction must be in [0, 1], got {max_echo_fraction}")
    try:
        pattern = re.compile(answer_pattern) if answer_pattern is not None else None
    except re.error as e:
        raise ValueError(f"answer_pattern {answer_pattern!r} is not a valid regular expression: {e}") from e
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")

    def well_formed(prompt: str, completion: str) -> bool:
        own, copied = strip_echo(prompt, completion)
        if copied > max_echo_fraction:
            return False
        spans = _answer_spans(own, answer_style, answer_tag)
        if spans is None or len(spans) != 1:
            return False
        start, end, content = spans[0]
        content = content.strip()
        if not content or (pattern is not None and not pattern.fullmatch(content)):
            return False
        if len(own[end:].strip()) > max_trailing_chars:
            return False
        if not require_reasoning:
            return True
        reasoning = _reasoning(own, start, reasoning_tag)
        return reasoning is not None and len(re.sub(r"\s", "", reasoning)) >= max(1, min_reasoning_chars)

    return [1.0 if well_formed(p, c) else 0.0 for p, c in zip(prompts, completions)]
