"""`PromptFormatter`: a dataset row to prompt token ids, with counters for what it rejects."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

_SCALAR = (str, int, float)
INVALID = "__grpo_jax_invalid_row__"  # a row its reader could not read (grpo_jax.data.files): the value says why


class Prompt(NamedTuple):
    text: str
    ids: list[int]
    messages: list[dict[str, str]] | None = None  # the (system and) user messages, before any chat template


class _Malformed(Exception):
    pass


def _template_fields(template: str) -> frozenset[str]:
    """Top-level row fields a str.format template reads ("{a.b[0]}" reads "a")."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        top = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not top or top.isdigit():
            raise ValueError(f"template {template!r} has a positional field {{{field}}}; name a row field instead")
        names.add(top)
    return frozenset(names)


class PromptFormatter:
    """Turns a row (dict of Python values) into prompt token ids, or None to skip it.

    With a chat template (`chat_template="auto"` and the tokenizer has one, or "always"), the
    formatted `template` is the user message, `system_prompt` the system message, and the
    prompt is `tokenizer.apply_chat_template(..., add_generation_prompt=True)`, encoded without
    adding special tokens (the chat template writes its own BOS). Without one, the prompt is
    `system_prompt + "\\n\\n" + template.format(**row)` encoded with the tokenizer's special
    tokens (e.g. a base model's BOS). `template=None` reads the row's `prompt` field: text, or
    a list of {"role", "content"} messages (chat template required).

    Prompts longer than `max_prompt_tokens` are skipped (`overlong="skip"`) or cut to their
    last tokens (`"truncate"`), keeping a leading BOS. The end is kept because that is where
    the model continues: the question's final sentence and the chat template's assistant
    header are at the end, while the start is usually instructions and context.

    `messages_field` names a field holding the prompt as a chat (a list of {"role", "content"}
    messages ending with a user or tool turn; a chat template required) or as text, in place of
    `template`; `system_prompt` is added to a chat that has no system message of its own. With
    `answer_field`, a row without that field (or with null) is malformed: rewards need it.

    `stats` counts formatted, skipped_overlong, skipped_malformed (missing field, wrong type,
    template error, empty text) and truncated; `last_skip_reason` says why the last row was
    skipped.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_prompt_tokens: int,
        template: str | None = "{question}",
        system_prompt: str | None = None,
        chat_template: Literal["auto", "always", "never"] = "auto",
        overlong: Literal["skip", "truncate"] = "skip",
        messages_field: str | None = None,
        answer_field: str | None = None,
    ):
        if chat_template not in ("auto", "always", "never"):
            raise ValueError(f"chat_template must be 'auto', 'always' or 'never', got {chat_template!r}")
        if overlong not in ("skip", "truncate"):
            raise ValueError(f"overlong must be 'skip' or 'truncate', got {overlong!r}")
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "always" and not has_chat:
            raise ValueError(
                "chat_template='always' but the tokenizer has no chat template; set "
                "tokenizer.chat_template or use chat_template='auto'/'never'"
            )
        self.tokenizer = tokenizer
        self.template = template
        self.system_prompt = system_prompt
        self.use_chat = has_chat and chat_template != "never"
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.overlong = overlong
        self.messages_field = messages_field if messages_field is not None else (None if template else "prompt")
        self.answer_field = answer_field
        self.prompt_fields = (frozenset({self.messages_field}) if self.messages_field is not None
                              else _template_fields(template))
        self.stats = {"formatted": 0, "skipped_overlong": 0, "skipped_malformed": 0, "truncated": 0}
        self.last_skip_reason: str | None = None

    def __call__(self, row: Mapping[str, Any]) -> list[int] | None:
        prompt = self.encode(row)
        return None if prompt is None else prompt.ids

    def encode(self, row: Mapping[str, Any]) -> Prompt | None:
        """(text, ids) of the row's prompt, or None (counted) when the row is skipped."""
        try:
            messages = self._messages(row)
        except _Malformed as e:
            return self._skip("skipped_malformed", str(e))
        if self.use_chat:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template that refuses this row's chat (roles, order): this row only
                return self._skip("skipped_malformed", f"the chat template failed on the row: {type(e).__name__}: {e}")
        else:
            text = "\n\n".join(m["content"] for m in messages)
        ids = list(self.tokenizer.encode(text, add_special_tokens=not self.use_chat))
        if len(ids) > self.max_prompt_tokens:
            if self.overlong == "skip":
                return self._skip("skipped_overlong", f"{len(ids)} tokens > max_prompt_tokens={self.max_prompt_tokens}")
            ids, tail = self._truncate(ids)
            text = self.tokenizer.decode(tail)
            self.stats["truncated"] += 1
        self.stats["formatted"] += 1
        return Prompt(text, ids, messages)

    def _messages(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        """The prompt's messages (system prompt first, if any); raises _Malformed for a bad row."""
        if not isinstance(row, Mapping):
            raise _Malformed(f"row is a {type(row).__name__}, not a dict")
        if INVALID in row:
            raise _Malformed(str(row[INVALID]))
        if self.answer_field is not None and row.get(self.answer_field) is None:
            raise _Malformed(f"row has no {self.answer_field!r} (missing or null): data.answer_field's reference "
                             "answer")
        if self.messages_field is not None:
            messages = self._messages_from_field(row, self.messages_field)
        else:
            for field in self.prompt_fields:
                if field not in row:
                    raise _Malformed(f"row has no field {field!r} (fields: {sorted(row)})")
                value = row[field]
                if not isinstance(value, _SCALAR) and not (
                    isinstance(value, (list, tuple)) and all(isinstance(v, _SCALAR) for v in value)
                ):
                    raise _Malformed(
                        f"field {field!r} is a {type(value).__name__}, not text, a number or a list of them"
                    )
            try:
                content = self.template.format(**row)
            except (KeyError, IndexError, AttributeError, ValueError, TypeError) as e:
                raise _Malformed(f"template {self.template!r} failed on the row: {e!r}") from e
            messages = [{"role": "user", "content": content}]
        if not any(m["content"].strip() for m in messages):
            raise _Malformed("the prompt is empty")
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def _messages_from_field(self, row: Mapping[str, Any], field: str) -> list[dict[str, str]]:
        """A chat (or plain text) in `row[field]`; it must end with a user (or tool) turn."""
        prompt = row.get(field)
        if prompt is None:
            raise _Malformed(f"row has no {field!r} (missing or null)")
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if not self.use_chat:
            raise _Malformed(f"row's {field!r} is not text (message lists need a chat template)")
        if (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
        ):
            if prompt[-1]["role"] == "assistant":
                raise _Malformed(f"row's {field!r} ends with an assistant turn; a prompt ends where the model answers")
            return [{"role": m["role"], "content": m["content"]} for m in prompt]
        raise _Malformed(f"row's {field!r} is neither text nor a list of {{'role', 'content'}} messages")

    def _truncate(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """(kept ids, kept ids without the leading BOS): the text of a truncated prompt is the
        decoded tail."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and ids[0] == bos and self.max_prompt_tokens >= 2:
            tail = ids[len(ids) - self.max_prompt_tokens + 1 :]
            return [ids[0], *tail], tail
        tail = ids[len(ids) - self.max_prompt_tokens :]
        return tail, tail

    def _skip(self, counter: str, reason: str) -> None:
        self.stats[counter] += 1
        self.last_skip_reason = reason
        return None
