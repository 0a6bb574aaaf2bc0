"""An episode's environment messages as tokens that extend the trajectory, never re-tokenising
what the model sampled.

After a model turn the trajectory is: the opening prompt's tokens, then every turn's sampled tokens
as sampled, with the environment's tokens in between. The environment's tokens of a turn are the
text the chat template adds after the model's sampled text: the rest of the model's turn as the
template closes it (e.g. ChatML's newline after `<|im_end|>`, or `<|im_end|>` itself when the turn
ended at a tool call's closing tag rather than a stop token), the environment's messages, and the
next generation prompt.

`extension(...)` renders the conversation with and without the new messages (the model's turn as
the text it sampled) and keeps only the difference. A template can break the extension property:
a thinking template that drops earlier `<think>` blocks once a new user message follows, a template
that trims the model's text or rewrites earlier turns. Then (`exact=False`) the sampled tokens stay
as they are and only the new messages are rendered, after a neutral stand-in conversation (one
user and one assistant message) so that a template's opening (a default system message, BOS) is
not repeated: the model sees the environment's answer as the template would render it after any
plain turn, though not the re-rendered history a fresh render would show it.
"""

from __future__ import annotations

import dataclasses

import jinja2

STAND_IN = ({"role": "user", "content": "0"}, {"role": "assistant", "content": "1"})


@dataclasses.dataclass(frozen=True)
class Extension:
    """The tokens to append after a model turn's sampled tokens, and how they were found."""

    ids: list[int]
    text: str
    exact: bool  # the chat template extended the real conversation (False: the stand-in fallback)


class TemplateRefused(ValueError):
    """The chat template raised on a conversation (e.g. roles that must alternate)."""


def render(tokenizer, messages, *, generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The conversation as the chat template writes it (with `tools`, the functions the template
    describes: an environment's `tools`)."""
    extra = {} if tools is None else {"tools": tools}
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                             **extra)
    except jinja2.TemplateError as e:
        raise TemplateRefused(str(e)) from None


def extension(tokenizer, history: list[dict], sampled_text: str, content: str, new_messages: list[dict],
              tools: list[dict] | None = None) -> Extension:
    """The environment's tokens after a model turn.

    `history`: the messages before the model's turn (the opening messages and earlier turns);
    `sampled_text`: the model's turn exactly as its sampled tokens decode (special tokens kept,
    the stop token included when it drew one); `content`: the turn's message content (the sampled
    text without the stop token); `new_messages`: the environment's answer. The result ends with
    the template's generation prompt for the next model turn; every render gets the episode's `tools`."""
    turn = {"role": "assistant", "content": content}
    before = render(tokenizer, history, generation_prompt=True, tools=tools)
    closed = render(tokenizer, [*history, turn], generation_prompt=False, tools=tools)
    try:
        extended = render(tokenizer, [*history, turn, *new_messages], generation_prompt=True, tools=tools)
    except TemplateRefused:
        extended = ""
    turn_text = closed[len(before):] if closed.startswith(before) else None
    if extended and turn_text is not None and turn_text.startswith(sampled_text) and extended.startswith(closed):
        text = closed[len(before) + len(sampled_text):] + extended[len(closed):]
        return Extension(ids=encode(tokenizer, text), text=text, exact=True)
    text = closing(tokenizer, sampled_text, tools) + new_only(tokenizer, new_messages, tools)
    return Extension(ids=encode(tokenizer, text), text=text, exact=False)


def closing(tokenizer, sampled_text: str, tools: list[dict] | None = None) -> str:
    """What the template writes after an assistant turn's content (from the stand-in conversation),
    less the part the model already sampled (its stop token, typically)."""
    user, assistant = STAND_IN
    before = render(tokenizer, [user], generation_prompt=True, tools=tools)
    closed = render(tokenizer, [user, assistant], generation_prompt=False, tools=tools)
    turn = closed[len(before):] if closed.startswith(before) else closed
    at = turn.rfind(assistant["content"])
    suffix = turn[at + len(assistant["content"]):] if at >= 0 else ""
    for cut in range(len(suffix), 0, -1):  # the longest head of the suffix the model already wrote
        if sampled_text.endswith(suffix[:cut]):
            return suffix[cut:]
    return suffix


def new_only(tokenizer, new_messages: list[dict], tools: list[dict] | None = None) -> str:
    """The new messages and the next generation prompt as the template renders them after a plain
    user/assistant exchange; ValueError when even that does not extend (the template cannot
    continue a conversation with these roles)."""
    closed = render(tokenizer, STAND_IN, generation_prompt=False, tools=tools)
    roles = ", ".join(m.get("role", "?") for m in new_messages)
    refused = (f"the chat template does not extend a conversation with messages of role {roles}: an environment "
               "must answer with roles the template renders after an assistant turn")
    try:
        extended = render(tokenizer, [*STAND_IN, *new_messages], generation_prompt=True, tools=tools)
    except TemplateRefused as e:
        raise ValueError(f"{refused} (the template says: {e})") from None
    if not extended.startswith(closed):
        raise ValueError(refused)
    return extended[len(closed):]


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
