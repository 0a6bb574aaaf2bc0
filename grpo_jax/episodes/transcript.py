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

Control-token text an environment writes (a tool that prints `<|im_end|>`, a user message that
contains `<eos>`) is text, never the control token: `guard` wraps it in two noncharacter markers
before rendering, and `encode` encodes what they wrap as plain text and the rest as usual, so only
the template's own control tokens become their ids (the scheme of transformers'
`apply_chat_template(..., sanitize_control_tokens=True)`, done here on the text diffs this module
works with). Control tokens: the tokenizer's special tokens and the added tokens its chat template
writes.
"""

from __future__ import annotations

import dataclasses
import re
import weakref

import jinja2

STAND_IN = ({"role": "user", "content": "0"}, {"role": "assistant", "content": "1"})
OPEN, CLOSE = "\ufdd0", "\ufdd1"  # Unicode noncharacters: around control-token text an environment wrote
MARKED = re.compile(f"{OPEN}([^{OPEN}{CLOSE}]*){CLOSE}|[{OPEN}{CLOSE}]")  # a marked span, or a stray marker
_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> TokenizerFacts


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
    the template's generation prompt for the next model turn; every render gets the episode's `tools`.
    Control-token text in the environment's messages is encoded as text (`guard`)."""
    history, new_messages = guard(tokenizer, history), guard(tokenizer, new_messages)
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
        return Extension(ids=encode(tokenizer, text), text=unmark(text), exact=True)
    text = closing(tokenizer, sampled_text, tools) + new_only(tokenizer, new_messages, tools)
    return Extension(ids=encode(tokenizer, text), text=unmark(text), exact=False)


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


@dataclasses.dataclass(frozen=True)
class TokenizerFacts:
    """What the host needs to know of a tokenizer, found once: `control`, a regex of its control
    tokens' texts (None: it has none); `longest`, the most characters one token can stand for (its
    longest vocabulary entry, at least 1), so that a text of more than n x `longest` characters
    has more than n tokens: the bound `too_many_tokens` checks before tokenising."""

    control: re.Pattern | None
    longest: int


def facts(tokenizer) -> TokenizerFacts:
    try:
        return _TOKENS[tokenizer]
    except (KeyError, TypeError):  # TypeError: not weak-referenceable (then not cached)
        pass
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    template = str(getattr(tokenizer, "chat_template", None) or "")
    texts = {t.content for t in added.values() if t.special or (t.content in template and not t.content.isspace())}
    texts |= set(getattr(tokenizer, "all_special_tokens", ()))
    texts.discard("")
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    found = TokenizerFacts(control=re.compile(trie_pattern(texts)) if texts else None,
                           longest=max([1, *map(len, vocab), *map(len, texts)]))
    try:
        _TOKENS[tokenizer] = found
    except TypeError:
        pass
    return found


def trie_pattern(words) -> str:
    """A regex matching any of `words` (the longest where one is a prefix of another), as a trie:
    each position costs the length of a word, not the number of words (Gemma 3 has 6,249 special
    tokens; their plain alternation took 10 us a character)."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[None] = True  # a word ends here

    def walk(node: dict) -> str:
        alts = [re.escape(ch) + walk(child) for ch, child in sorted((k, v) for k, v in node.items() if k is not None)]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if None in node else body

    return walk(trie)


def too_many_tokens(tokenizer, texts, limit: int) -> bool:
    """`texts` (strings) have more than `limit` tokens for certain, by their length alone: no token
    stands for more characters than the vocabulary's longest entry. (A normaliser that deletes
    characters could make fewer tokens of such a text; it is refused all the same.)"""
    return sum(map(len, texts)) > limit * facts(tokenizer).longest


def guard(tokenizer, messages: list[dict], *, assistant: bool = False) -> list[dict]:
    """`messages` with the control-token text in every non-assistant message's content wrapped in
    the markers `encode` reads (markers already in the content are dropped: they cannot forge a
    span). The model's own turns are left as sampled; `assistant`: guard assistant messages too
    (an opening's, which the environment wrote: Episode guards its opening once with it)."""
    control = facts(tokenizer).control
    out = []
    for m in messages:
        text = m.get("content")
        if (assistant or m.get("role") != "assistant") and isinstance(text, str):
            text = text.replace(OPEN, "").replace(CLOSE, "")
            m = {**m, "content": control.sub(lambda t: OPEN + t.group() + CLOSE, text) if control else text}
        out.append(m)
    return out


def unmark(text: str) -> str:
    """Rendered text without `guard`'s markers (what the transcript shows)."""
    return text.replace(OPEN, "").replace(CLOSE, "")


def encode(tokenizer, text: str) -> list[int]:
    """`text`'s tokens (no BOS/EOS added); the spans `guard` marked are encoded as plain text, so
    the control tokens in them are their characters' tokens, not the control token."""
    if OPEN not in text and CLOSE not in text:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    pieces = MARKED.split(text)  # [text, span, text, span, ..., text]; a stray marker: span None
    ids = _piece(tokenizer, pieces[0], plain=False, first=True)
    for i, piece in enumerate(pieces[1:], start=1):
        if piece:
            ids += _piece(tokenizer, piece, plain=i % 2 == 1, first=not ids)
    return ids


def _piece(tokenizer, piece: str, *, plain: bool, first: bool) -> list[int]:
    """One piece of a marked text; `plain`: without matching any control token. A piece after the
    first is encoded after a newline that is then dropped, so a SentencePiece tokenizer adds no
    prefix space in the middle of the text (transformers' `encode_marked_chat` does the same)."""
    enc = _plain_encoder(tokenizer) if plain else (lambda t: list(tokenizer(t, add_special_tokens=False)["input_ids"]))
    if first:
        return enc(piece) if piece else []
    newline, ids = enc("\n"), enc("\n" + piece)
    return ids[len(newline):] if ids[:len(newline)] == newline else enc(piece)


def _plain_encoder(tokenizer):
    """Text -> ids without any added token matched: a fast tokenizer's normaliser, pre-tokeniser
    and model run directly (no state is switched, so threads may share the tokenizer); else
    transformers' `split_special_tokens`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda text: list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def enc(text: str) -> list[int]:
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
        return [t.id for split in splits for t in backend.model.tokenize(split)]

    return enc
