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

Tags are paired in one pass over the text (`tag_blocks`), so no completion, however many unclosed
tags it holds, costs more than linear time. Every completion can be judged, so this never returns
None.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import unicodedata
from collections.abc import Sequence
from typing import Literal

from grpo_jax.rewards.math import boxed_contents, strip_echo

AnswerStyle = Literal["boxed", "gsm8k", "tag"]
ANSWER_STYLES: tuple[str, ...] = ("boxed", "gsm8k", "tag")
# One integer, optionally with thousands separators: 72, -5, 1,234, 12,345,678 (not 1,23 nor 0,1,2).
INTEGER_PATTERN = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)"
_TAG_NAME = re.compile(r"[A-Za-z][\w-]*")
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")  # a Unicode letter or digit (never a control, format or surrogate)
# Markup that may close a completion after its answer: `</tag>`, `\\end{name}`, `$` (and
# punctuation: `.`, `\\]`, `\\)`, `**`).
_CLOSING_MARKUP = re.compile(r"</[A-Za-z][A-Za-z_-]*\s*>|\\end\{[A-Za-z]+\*?\}|\$")  # no digits in names
_MAX_PATTERN_INPUT = 1000  # a longer answer never matches answer_pattern (a user regex, bounded input)


def tag_blocks(text: str, tag: str) -> list[tuple[int, int, str]] | None:
    """(start, end, content) of every `<tag>...</tag>` block of `text` in order, or None when the
    tags do not pair up: an opening left open, a closing without an opening, or a block opened
    inside another. One pass: each part of the text is searched a bounded number of times."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    blocks, pos = [], 0
    while True:
        start, stop = text.find(opening, pos), text.find(closing, pos)
        if start == -1:
            return blocks if stop == -1 else None
        if stop == -1 or stop < start:
            return None
        inner = text.find(opening, start + len(opening), stop)
        if inner != -1:
            return None
        blocks.append((start, stop + len(closing), text[start + len(opening):stop]))
        pos = stop + len(closing)


def has_words(text: str, at_least: int) -> bool:
    """Whether `text` holds `at_least` letters or digits (Unicode categories L and N): spaces,
    punctuation, control characters (NUL), format characters (zero-width spaces) and lone
    surrogates are not reasoning, however many there are."""
    return sum(1 for _ in itertools.islice(_LETTER_OR_DIGIT.finditer(text), at_least)) >= at_least


def only_closing(text: str) -> bool:
    """Whether `text` (what follows the answer) is only whitespace, punctuation and closing
    markup (`_CLOSING_MARKUP`): no words, no digits, no symbols, no invisible characters."""
    rest = _CLOSING_MARKUP.sub("", text)
    return all(c.isspace() or unicodedata.category(c).startswith("P") for c in rest)


def _visible(text: str) -> bool:
    """Whether `text` has a character that shows: not whitespace, control, format or surrogate."""
    return any(c.isprintable() and not c.isspace() for c in text)


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
    return tag_blocks(text, tag)


def _reasoning(text: str, answer_start: int, reasoning_tag: str | None) -> str | None:
    """The reasoning before the answer, or None when a required reasoning block is missing."""
    if reasoning_tag is None:
        return text[:answer_start]
    blocks = tag_blocks(text, reasoning_tag)
    if blocks is None or len(blocks) != 1 or blocks[0][1] > answer_start:
        return None
    return blocks[0][2]


def format_reward(prompts: Sequence[str], completions: Sequence[str], *, answer_style: AnswerStyle = "boxed",
                  answer_tag: str = "answer", reasoning_tag: str | None = None, require_reasoning: bool = True,
                  min_reasoning_chars: int = 20, answer_pattern: str | None = None, max_trailing_chars: int = 20,
                  max_echo_fraction: float = 0.5, **_: object) -> list[float | None]:
    """1.0 for a well-formed completion, else 0.0.

    Well-formed means, on the completion's own text (copies of the prompt blanked out):
    - exactly one answer marker of `answer_style`, not left open, whose content has a visible
      character (not only spaces, NULs or zero-width characters) and fully matches
      `answer_pattern` when given; `INTEGER_PATTERN` (`-?(?:\\d{1,3}(?:,\\d{3})+|\\d+)`) is one
      integer, thousands separators allowed (72, -5, 1,234), never a list (0,1,2,...,500). Content
      longer than 1000 characters never matches a pattern. Two markers are two final answers,
      even when they agree: the form asks for one.
    - after the answer, at most `max_trailing_chars` characters, and those only whitespace,
      punctuation and closing markup (`.`, `$`, `\\]`, `**`, `</think>`, `\\end{align}`): the
      answer is the end of the completion, so `\\boxed{72} or 48` fails.
    - when `require_reasoning`, at least `min_reasoning_chars` letters or digits of reasoning
      before the answer (inside the `reasoning_tag` block when one is set); punctuation, control
      and format characters and lone surrogates do not count, so 30 dots, NUL bytes or zero-width
      spaces are not reasoning, nor is a bare number or "The answer is \\boxed{5}".
    - at most `max_echo_fraction` of the completion's words copied from the prompt.
    """
    rules = _Rules.checked(answer_style, answer_tag, reasoning_tag, require_reasoning, min_reasoning_chars,
                           answer_pattern, max_trailing_chars, max_echo_fraction)
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    return [1.0 if rules.well_formed(p, c) else 0.0 for p, c in zip(prompts, completions)]


@dataclasses.dataclass(frozen=True)
class _Rules:
    answer_style: str
    answer_tag: str
    reasoning_tag: str | None
    require_reasoning: bool
    min_reasoning_chars: int
    pattern: re.Pattern | None
    max_trailing_chars: int
    max_echo_fraction: float

    @classmethod
    def checked(cls, answer_style, answer_tag, reasoning_tag, require_reasoning, min_reasoning_chars,
                answer_pattern, max_trailing_chars, max_echo_fraction) -> _Rules:
        """The options, checked: a misconfiguration is a ValueError before any sample is scored."""
        if answer_style not in ANSWER_STYLES:
            raise ValueError(f"answer_style must be one of {ANSWER_STYLES}, got {answer_style!r}")
        for name, tag in (("answer_tag", answer_tag), ("reasoning_tag", reasoning_tag)):
            if tag is not None and not _TAG_NAME.fullmatch(tag):
                raise ValueError(f"{name} must be a bare tag name such as 'answer' or 'think' (no brackets), "
                                 f"got {tag!r}")
        if min_reasoning_chars < 0 or max_trailing_chars < 0:
            raise ValueError(f"min_reasoning_chars and max_trailing_chars must be >= 0, got "
                             f"{min_reasoning_chars} and {max_trailing_chars}")
        if not 0.0 <= max_echo_fraction <= 1.0:
            raise ValueError(f"max_echo_fraction must be in [0, 1], got {max_echo_fraction}")
        try:
            pattern = re.compile(answer_pattern) if answer_pattern is not None else None
        except re.error as e:
            raise ValueError(f"answer_pattern {answer_pattern!r} is not a valid regular expression: {e}") from e
        return cls(answer_style, answer_tag, reasoning_tag, require_reasoning, min_reasoning_chars, pattern,
                   max_trailing_chars, max_echo_fraction)

    def well_formed(self, prompt: str, completion: str) -> bool:
        own, copied = strip_echo(prompt, completion)
        if copied > self.max_echo_fraction:
            return False
        spans = _answer_spans(own, self.answer_style, self.answer_tag)
        if spans is None or len(spans) != 1:
            return False
        start, end, content = spans[0]
        content = content.strip()
        if not _visible(content) or (self.pattern is not None and not (
                len(content) <= _MAX_PATTERN_INPUT and self.pattern.fullmatch(content))):
            return False
        trailing = own[end:].strip()
        if len(trailing) > self.max_trailing_chars or not only_closing(trailing):
            return False
        if not self.require_reasoning:
            return True
        reasoning = _reasoning(own, start, self.reasoning_tag)
        return reasoning is not None and has_words(reasoning, max(1, self.min_reasoning_chars))
