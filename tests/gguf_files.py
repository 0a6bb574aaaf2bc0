"""Helpers for the tests of real GGUF files (tests/models/test_gguf*.py): one parse per file, and
what a run sees of a tokenizer (`tokenizer_behaviour`), to compare ours with transformers'.

A GGUF test loads one file four times: our conversion (the weights and the tokenizer, from one
reader), and transformers' reference (its config, its weights, its tokenizer). Our conversion reads
the file with grpo_jax/models/gguf_reader.py; the reference's config parses it with
`gguf.GGUFReader` (Gemma 3's 262,144-token vocabulary takes that ~10 s on these machines);
transformers 5.24 reads the tokenizer, and the weights of the architectures its GGUF quantizer
covers, with a reader of its own. `one_parse_per_file` makes each `gguf.GGUFReader` parse and
each `gguf.dequantize` of the same bytes happen once per process: what the tests compare (our
reader, name mapping, layouts, q/k un-permutation, config, tokenizer files and model code against
transformers' own) is computed by each side as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import numpy as np
import pytest


@contextlib.contextmanager
def one_parse_per_file():
    """Within the block, `gguf.GGUFReader(path)` returns one reader per unchanged file and
    `gguf.dequantize` computes each tensor once (callers get their own copy)."""
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
        # Each side maps the file itself: the bytes, their shape and type name the tensor.
        key = (hashlib.blake2b(np.ascontiguousarray(data).data).digest(), data.shape, data.dtype.str, int(qtype))
        if key not in tensors:
            tensors[key] = dequantize(data, qtype)
        return np.array(tensors[key], copy=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "dequantize", dequantize_once)
        mp.setattr(quants, "dequantize", dequantize_once)
        yield


def reader_mismatches(path) -> list[str]:
    """Where grpo_jax's GGUF reader (models/gguf_reader.py) and `gguf.GGUFReader` read `path`
    differently: each field's key, value and Python type, each tensor's name, type, shape, the dtype
    and shape of its data and every byte of it."""
    import gguf

    from grpo_jax.models.gguf_reader import Reader, read

    ours, theirs = read(path), gguf.GGUFReader(str(path))
    assert isinstance(ours, Reader)  # a little-endian file: ours, not gguf's
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # gguf's own header entries
    out = [] if keys == list(ours.fields) else [f"keys: {sorted(set(keys) ^ set(ours.fields))}"]
    for key in keys:
        want, got = theirs.fields[key].contents(), ours.fields.get(key)
        if want != got or type(want) is not type(got) or (
                isinstance(want, list) and any(type(a) is not type(b) for a, b in zip(want, got))):
            out.append(f"field {key}: {str(got)[:60]} != {str(want)[:60]}")
    if len(ours.tensors) != len(theirs.tensors):
        out.append(f"{len(ours.tensors)} tensors != {len(theirs.tensors)}")
    for a, b in zip(ours.tensors, theirs.tensors):
        same = (a.name, a.tensor_type, a.shape.tolist(), a.data.dtype, a.data.shape) == \
            (b.name, b.tensor_type, b.shape.tolist(), b.data.dtype, b.data.shape)
        if not (same and a.data.tobytes() == np.asarray(b.data).tobytes()):
            out.append(f"tensor {b.name}")
    return out


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
