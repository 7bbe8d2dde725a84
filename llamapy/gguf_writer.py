"""Writing GGUF files: header, typed metadata, tensor infos and aligned data (version 3,
little-endian), the layout gguf_file.py reads and llama.cpp's gguf writer produces.

Our own writer, the reader's counterpart: every metadata value is written with the type it
was read with (empty and nested arrays included, strings as their original bytes), tensor
bytes go from memory (or the source's map) to the file without a copy, and a training
process never imports the `gguf` package (3 MB of modules, yaml among them) to save.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ggmlpy import GGMLType
from ggmlpy.types import TYPE_TRAITS, row_size

from .gguf_file import _NUMPY, GGUF_DEFAULT_ALIGNMENT, MetaValue, StringArray, ValueType

GGUF_VERSION = 3

_SCALAR_FORMAT = {ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
                  ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<?",
                  ValueType.UINT64: "<Q", ValueType.INT64: "<q", ValueType.FLOAT64: "<d"}


@dataclass(frozen=True)
class TensorOut:
    """One tensor to write: its name, type, dimensions as stored (ggml order, ne[0] first)
    and its bytes (rows packed one after another), or a function that makes them in pieces
    when the file is written (a quantizer: one tensor's output in memory at a time)."""

    name: str
    type: GGMLType
    ne: tuple[int, ...]
    data: np.ndarray | Callable[[], Iterable[np.ndarray]]  # uint8, contiguous; or its pieces in order

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, np.ndarray):
            return self.data.nbytes
        n_rows = 1
        for n in self.ne[1:]:
            n_rows *= n
        return row_size(self.type, self.ne[0]) * n_rows


# the tensor type of a numpy array: ggmlpy's element types (BF16's uint16 is a bit pattern, not a value)
_TYPE_OF_DTYPE = {tr.np_dtype: t for t, tr in TYPE_TRAITS.items() if tr.np_dtype is not None and t != GGMLType.BF16}


def array_out(name: str, values: np.ndarray) -> TensorOut:
    """A numpy array as a tensor of its element type (numpy shape = ne reversed)."""
    values = np.ascontiguousarray(values)
    if values.dtype not in _TYPE_OF_DTYPE:
        raise ValueError(f"tensor {name!r}: numpy {values.dtype} has no GGUF tensor type")
    return TensorOut(name, _TYPE_OF_DTYPE[values.dtype], values.shape[::-1] or (1,), values.reshape(-1).view(np.uint8))


def _raw(text: str | bytes) -> bytes:
    """A string's bytes as stored (the reader keeps non-UTF-8 bytes via surrogateescape)."""
    return text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")


def _string(text: str | bytes) -> bytes:
    raw = _raw(text)
    return struct.pack("<Q", len(raw)) + raw


_STRINGS_PER_CHUNK = 4096


def _value_chunks(vtype: ValueType, value: Any, sub: ValueType | None = None) -> Iterator[bytes]:
    """A metadata value's bytes after its type tag, in pieces: a vocabulary's 262,144 strings
    go to the file a chunk at a time, never joined whole in memory."""
    if vtype == ValueType.STRING:
        yield _string(value)
    elif vtype != ValueType.ARRAY:
        yield struct.pack(_SCALAR_FORMAT[vtype], value)
    else:
        yield struct.pack("<IQ", sub, len(value))
        if isinstance(value, StringArray) and sub == ValueType.STRING:  # as read: its bytes
            yield value.raw
        elif sub == ValueType.STRING:  # a few thousand at a time: few writes, little memory
            for i in range(0, len(value), _STRINGS_PER_CHUNK):
                yield b"".join(map(_string, value[i:i + _STRINGS_PER_CHUNK]))
        elif sub == ValueType.ARRAY:  # inner arrays as the reader gives them, each with its own item type
            for item in value:
                if not isinstance(item, MetaValue) or item.type != ValueType.ARRAY:
                    raise ValueError("the items of an array of arrays must be MetaValue arrays")
                yield from _value_chunks(ValueType.ARRAY, item.value, ValueType(item.sub_type))
        else:
            yield np.asarray(value, dtype=np.dtype(_NUMPY[sub]).newbyteorder("<")).tobytes()


def _padding(n: int, alignment: int) -> int:
    return -n % alignment


def write_gguf(out: BinaryIO, metadata: Mapping[str, MetaValue], tensors: Sequence[TensorOut]) -> None:
    """Write a whole GGUF file to `out`: metadata in the given order (its general.alignment,
    when present, aligns the data; else 32 bytes), then the tensors in the given order."""
    alignment = int(metadata["general.alignment"].value) if "general.alignment" in metadata \
        else GGUF_DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment = {alignment} is not a power of two")
    written = 0

    def put(chunk: bytes) -> None:
        nonlocal written
        out.write(chunk)
        written += len(chunk)

    put(b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata)))
    for key, mv in metadata.items():
        put(_string(key) + struct.pack("<I", mv.type))
        try:
            sub = None if mv.sub_type is None else ValueType(mv.sub_type)
            for chunk in _value_chunks(ValueType(mv.type), mv.value, sub):
                put(chunk)
        except (ValueError, TypeError, OverflowError, struct.error) as e:
            raise ValueError(f"metadata {key!r}: {e}") from None
    offset = 0
    for t in tensors:
        put(_string(t.name) + struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.type, offset))
        offset += t.nbytes + _padding(t.nbytes, alignment)
    out.write(bytes(_padding(written, alignment)))
    for t in tensors:
        pieces = [t.data] if isinstance(t.data, np.ndarray) else t.data()
        n = 0
        for piece in pieces:
            out.write(memoryview(np.ascontiguousarray(piece)).cast("B"))
            n += piece.nbytes
        if n != t.nbytes:
            raise ValueError(f"tensor {t.name!r}: {n} bytes made, {t.nbytes} announced")
        out.write(bytes(_padding(t.nbytes, alignment)))
