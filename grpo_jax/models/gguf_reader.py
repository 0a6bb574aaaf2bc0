"""A GGUF file's metadata and tensors, read in bulk.

`gguf.GGUFReader` reads every element of an array field through a memory-map view of its own:
Gemma 3's 262,144 token strings (and their scores and types) take it ~9 s on a 2-core machine,
on every first load of the model. `read(path)` reads the same file's fields with one pass of
`struct` over the mapped bytes and numeric arrays as one NumPy view each (well under a second),
and lays each tensor's data out as `gguf.GGUFReader` does (its own dtype for float and integer
tensors, rows of bytes for quantised ones), so `gguf.dequantize` takes it unchanged. A big-endian
file (rare) is read by `gguf.GGUFReader` itself.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MAGIC = 0x46554747  # b"GGUF", little-endian
VERSIONS = (2, 3)
# GGUF's value types: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
# The scalar types as `struct` codes (little-endian, standard sizes; NumPy reads the same codes).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's dims, innermost first (as gguf.GGUFReader's ReaderTensor.shape)
    data: np.ndarray  # a read-only view of the mapped file


class Reader:
    """`fields`: key -> value (str, int, float, bool or a list of them); `tensors`: in file order."""

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        if Path(path).stat().st_size == 0:
            raise ValueError("GGUF file is empty")
        self.data = np.memmap(path, mode="r")
        self.buffer, self.offset = memoryview(self.data), 0
        magic, version = self.unpack("<II")
        if magic != MAGIC:
            raise ValueError(f"not a GGUF file (magic {magic:#x})")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (supported: {VERSIONS})")
        n_tensors, n_fields = self.unpack("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self.string()
            if key in self.fields:
                raise KeyError(f"GGUF field {key!r} appears twice")
            self.fields[key] = self.value(*self.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            dims = self.unpack(f"<{self.unpack('<I')[0]}Q")
            infos.append((name, dims, *self.unpack("<IQ")))
        alignment = self.fields.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"GGUF alignment {alignment!r} is not a power of two")
        start = -(-self.offset // alignment) * alignment
        plain = {GGMLQuantizationType[name]: dtype for name, dtype in (
            ("F16", np.float16), ("F32", np.float32), ("F64", np.float64), ("I8", np.int8), ("I16", np.int16),
            ("I32", np.int32), ("I64", np.int64))}
        self.tensors: list[Tensor] = []
        if len({info[0] for info in infos}) < len(infos):
            raise ValueError("GGUF file names a tensor twice")
        for name, dims, kind, offset in infos:
            qtype = GGMLQuantizationType(kind)
            count, shape = math.prod(dims), tuple(reversed(dims))
            if qtype in plain:
                dtype = plain[qtype]
            else:
                block, size = GGML_QUANT_SIZES[qtype]
                dtype, count, shape = np.uint8, count * size // block, quant_shape_to_byte_shape(shape, qtype)
            if start + offset + count * np.dtype(dtype).itemsize > len(self.buffer):
                raise ValueError(f"GGUF file ends at byte {len(self.buffer):,}, inside tensor {name!r}")
            data = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=start + offset).reshape(shape)
            self.tensors.append(Tensor(name, qtype, np.asarray(dims, np.uint64), data))

    def unpack(self, layout: str) -> tuple:
        try:
            values = struct.unpack_from(layout, self.buffer, self.offset)
        except struct.error:
            raise ValueError(f"GGUF file ends at byte {len(self.buffer):,}, inside its header") from None
        self.offset += struct.calcsize(layout)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + length
        if self.offset > len(self.buffer):
            raise ValueError(f"GGUF file ends at byte {len(self.buffer):,}, inside a string of {length:,} bytes")
        return str(self.buffer[start:self.offset], "utf-8")

    def value(self, kind: int) -> Any:
        if kind in SCALARS:
            (value,) = self.unpack("<" + SCALARS[kind])
            return value
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"GGUF value type {kind} is unknown")
        item, length = self.unpack("<IQ")
        if item in SCALARS:  # one view for the whole array
            if self.offset + length * struct.calcsize(SCALARS[item]) > len(self.buffer):
                raise ValueError(f"GGUF file ends at byte {len(self.buffer):,}, inside an array of {length:,} values")
            values = np.frombuffer(self.buffer, dtype="<" + SCALARS[item], count=length, offset=self.offset)
            self.offset += values.nbytes
            return values.tolist()
        return [self.value(item) for _ in range(length)]


def read(path: str | Path):
    """The file's reader: ours, or `gguf.GGUFReader` for a big-endian file (its `fields` then hold
    gguf's ReaderFields, which `models.gguf` reads through their `contents()`)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8 and struct.unpack("<II", head)[1] & 0xFFFF == 0:  # the version, byte-swapped
        from gguf import GGUFReader

        return GGUFReader(str(path))
    return Reader(path)
