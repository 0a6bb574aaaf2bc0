"""Helpers for the tests of real GGUF files (tests/models/test_gguf*.py).

A GGUF test loads one file five times: our conversion (the weights, then transformers' tokenizer
from the file), and transformers' reference (its config, its weights, its tokenizer). Each load
parses the file's metadata with `gguf.GGUFReader` (Gemma 3's 262,144-token vocabulary takes tens of
seconds to parse on these machines) and dequantises with `gguf.dequantize`. Both are the gguf
package's, the same functions on both sides, so `one_parse_per_file` does each once per file and
process: what the tests compare (our name mapping, layouts, q/k un-permutation, config, tokenizer
files and model code against transformers' own) is computed by each side as before.
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
