"""A GGUF file's metadata and tensor table, read in one pass: what kvforge takes from `gguf.GGUFReader`, faster.

Why not `gguf.GGUFReader`: it keeps every array element of the metadata as numpy views of the mapped file,
several objects per element. A vocabulary is three such arrays (tokens, scores, types), so opening the
default model's file (49,152 tokens and as many merges) took 3.4 s, and Gemma 3's (262,144 tokens) 11.6 s,
every time a model was loaded and again when its GGUF codes were attached. Here the header is parsed from
bytes with `struct`, numeric arrays become one numpy array each, and only the tensors' data stays mapped:
the same values, in about 1/20 of the time (`tests/test_gguf_file.py` holds both readers to the same
fields and tensors).

The subset kvforge uses, under GGUFReader's names: `fields[key].contents()` (a Python scalar, str, or list),
and `tensors`, each with `name`, `tensor_type`, `shape` (GGUF order, fastest dimension first),
`n_elements`, `n_bytes`, `data_offset` and `data` (a view of the memory map: typed for F16 / F32 / F64 /
integer tensors, else uint8 rows of blocks), and `data` for the whole map. Little-endian files only (what
llama.cpp writes); another byte order is refused.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUFValueType: code -> (struct format, numpy dtype) for the scalar types; 8 is a string, 9 an array
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
STRING, ARRAY = 8, 9
# tensor types stored as typed elements (GGUFReader's choice); every other type is uint8 rows of blocks
_TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class Field:
    """One metadata value: `value` is a Python scalar or str, a numpy array (numeric arrays), or a list
    (arrays of strings or of arrays)."""

    name: str
    value: Any
    type: int  # GGUFValueType of the value (ARRAY for arrays)

    def contents(self) -> Any:
        """The value as GGUFReader's `contents()` gives it: arrays as lists of Python values."""
        return _plain(self.value)


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF order: the fastest dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from the header bytes, raising ValueError past their end."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"the file ends inside its header (wanted {n} bytes at {self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.take(size))[0]

    def string(self) -> str:
        return str(self.take(self.scalar("<Q")), encoding="utf-8")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALARS:
                dtype = np.dtype(_SCALARS[itype][1]).newbyteorder("<")
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


class GGUFFile:
    """The file at `path`, memory-mapped read-only; `fields` and `tensors` as described above."""

    def __init__(self, path: str | PathLike[str]) -> None:
        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError("GGUF magic invalid")
        cur = _Cursor(buf)
        cur.take(4)
        version = cur.scalar("<I")
        if version & 0xFFFF == 0:
            raise ValueError("this GGUF file is big-endian; kvforge reads little-endian files")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {VERSIONS})")
        n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
        self.fields: dict[str, Field] = {
            "GGUF.version": Field("GGUF.version", version, 4),
            "GGUF.tensor_count": Field("GGUF.tensor_count", n_tensors, 10),
            "GGUF.kv_count": Field("GGUF.kv_count", n_fields, 10),
        }
        for _ in range(n_fields):
            key = cur.string()
            vtype = cur.scalar("<I")
            self.fields[key] = Field(key, cur.value(vtype), vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = np.array([cur.scalar("<Q") for _ in range(cur.scalar("<I"))], dtype=np.uint64)
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = self.fields.get("general.alignment")
        self.alignment = DEFAULT_ALIGNMENT
        if align is not None:
            if align.type != 4:
                raise ValueError("Bad type for general.alignment field")
            self.alignment = int(align.value)
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("the GGUF file names a tensor twice")

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, offset: int) -> Tensor:
        qtype = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        start = self.data_offset + offset
        np_dims = tuple(int(d) for d in reversed(dims.tolist()))
        if start + n_bytes > len(self.data):
            raise ValueError(f"tensor {name!r} lies past the end of the file")
        if qtype in _TYPED:
            data = self.data[start:start + n_bytes].view(_TYPED[qtype]).reshape(np_dims)
        else:
            data = self.data[start:start + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, qtype))
        return Tensor(name, qtype, dims, n_elems, n_bytes, start, data)
