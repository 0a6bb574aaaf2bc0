"""`char_tokenizer`: a character-level Hugging Face tokenizer for tiny models trained from scratch."""

from __future__ import annotations

import string
from typing import Any

DEFAULT_ALPHABET = string.digits + string.ascii_letters + " " + string.punctuation + "\n"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3; characters follow


def char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET,
    *,
    add_bos: bool = False,
    chat_template: str | None = None,
    model_max_length: int | None = None,
) -> Any:
    """A `transformers.PreTrainedTokenizerFast` with one token per character of `alphabet`.

    Ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then the alphabet's characters in order; other
    characters encode to <unk>. `decode(encode(s)) == s` for any s over the alphabet (with
    add_bos=True, `encode` starts with <bos>: decode with skip_special_tokens=True). Like every
    HF tokenizer, the text "<eos>" etc. encodes as the special token, not as characters.
    `save_pretrained(dir)` writes a directory that `AutoTokenizer.from_pretrained(dir)` loads
    with the same ids. No chat template unless `chat_template` (Jinja) is given.
    """
    # Imported here: transformers takes seconds to import and the rest of grpo_jax.data needs
    # only duck-typed tokenizers.
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if not alphabet:
        raise ValueError("alphabet is empty")
    duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if duplicates:
        raise ValueError(f"alphabet repeats characters {duplicates}")
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own pre-token (\s\S: "." would skip newlines).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join tokens without separators
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
        )
    kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        **kwargs,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
