"""Helpers for the tests of real GGUF files (tests/models/test_gguf*.py): one parse per file, and
what a run sees of a tokenizer (`tokenizer_behaviour`), to compare ours with transformers'.

A GGUF test loads one file four times: our conversion (the weights and the tokenizer, from one
reader), and transformers' reference (its config, its weights, its tokenizer). Our conversion and
the reference's config parse the file's metadata with `gguf.GGUFReader` (Gemma 3's 262,144-token
vocabulary takes tens of seconds to parse on these machines); transformers 5.24 reads the tokenizer,
and the weights of the architectures its GGUF quantizer covers, with a reader of its own.
`one_parse_per_file` makes each `gguf.GGUFReader` parse and each `gguf.dequantize` happen once per
file and process: what the tests compare (our name mapping, layouts, q/k un-permutation, config,
tokenizer files and model code against transformers' own) is computed by each side as before.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest


@contextlib.contextmanager
def one_parse_per_file():
    """Within the block, `gguf.GGUFReader(path)` returns one reader per unchanged file and
    `gguf.dequantize` computes each tensor of a reader once (callers get their own copy)."""
    import gguf
    from gguf import quants

    readers, tensors = {}, {}
    make_reader, dequantize = gguf.GGUFReader, quants.dequantize

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.realpath(path), mode, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    def dequantize_once(data, qtype):
        # The shared reader hands both sides the same memory-mapped views: their address, shape and
        # type name the tensor.
        key = (data.__array_interface__["data"][0], data.shape, data.dtype.str, int(qtype))
        if key not in tensors:
            tensors[key] = dequantize(data, qtype)
        return np.array(tensors[key], copy=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "dequantize", dequantize_once)
        mp.setattr(quants, "dequantize", dequantize_once)
        yield


# Plain ASCII, digits (split one by one or in threes), runs of spaces, tabs and newlines, accents and
# CJK, emoji (byte fallback in SentencePiece, multi-byte tokens in byte-level BPE), and no text.
SAMPLES = ("Hello world", "12 + 35 = 47, 1234567", "  two  spaces\tand\nnewlines\n\n", "naïve café Größe 東京",
           "emoji 🙂👍🏽", "")
CONVERSATION = [{"role": "user", "content": "What is 2 + 3?"}]


def tokenizer_behaviour(tokenizer) -> dict:
    """What a run sees of `tokenizer`: the ids of `SAMPLES` and of its own special tokens' text (kept
    whole or cut into pieces), the text decoded back, the special tokens' ids, whether it adds BOS/EOS,
    its vocabulary's size, and the chat template rendered for a short conversation.

    Whether it adds BOS/EOS is read from what it encodes, not from `add_bos_token`: transformers'
    `save_pretrained` does not write that flag (its post-processor keeps adding BOS), so a tokenizer
    loaded back from a converted directory says False and still adds it."""
    specials = [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token]
    texts = [*SAMPLES, " x ".join(t for t in specials if t)]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    chat = (tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
            if tokenizer.chat_template else None)
    return {"ids": ids, "decoded": [tokenizer.decode(i, skip_special_tokens=True) for i in ids],
            "special_tokens": specials, "special_ids": [tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                        tokenizer.pad_token_id, tokenizer.unk_token_id],
            "adds_bos_eos": [ids[0][:1] == [tokenizer.bos_token_id], ids[0][-1:] == [tokenizer.eos_token_id]],
            "vocabulary": len(tokenizer),
            "chat": chat}
