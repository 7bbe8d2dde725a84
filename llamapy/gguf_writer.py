"""Writing GGUF files: header, typed metadata, tensor infos and aligned data (version 3,
little-endian), the layout gguf_file.py reads and llama.cpp's gguf writer produces.

Our own writer, the reader's counterpart: every metadata value is written with the type it
was read with (empty and nested arrays included, strings as their original bytes), tensor
bytes go from memory (or the source's map) to the file without a copy, and a training
process never imports the `gguf` package (3 MB of modules, yaml among them) to save.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ggmlpy import GGMLType

from .gguf_file import _NUMPY, GGUF_DEFAULT_ALIGNMENT, MetaValue, ValueType

GGUF_VERSION = 3

_SCALAR_FORMAT = {ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
                  ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<?",
                  ValueType.UINT64: "<Q", ValueType.INT64: "<q", ValueType.FLOAT64: "<d"}


@dataclass(frozen=True)
class TensorOut:
    """One tensor to write: its name, type, dimensions as stored (ggml order, ne[0] first)
    and its bytes (rows packed one after another)."""

    name: str
    type: GGMLType
    ne: tuple[int, ...]
    data: np.ndarray  # uint8, contiguous


_TYPE_OF_DTYPE = {np.dtype(np.float32): GGMLType.F32, np.dtype(np.float16): GGMLType.F16,
                  np.dtype(np.float64): GGMLType.F64, np.dtype(np.int8): GGMLType.I8, np.dtype(np.int16): GGMLType.I16,
                  np.dtype(np.int32): GGMLType.I32, np.dtype(np.int64): GGMLType.I64}


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


def _array_items(sub: ValueType, items: Any) -> bytes:
    if sub == ValueType.STRING:
        return b"".join(_string(s) for s in items)
    if sub == ValueType.ARRAY:
        return b"".join(_nested(item) for item in items)
    return np.asarray(items, dtype=np.dtype(_NUMPY[sub]).newbyteorder("<")).tobytes()


def _nested(item: Any) -> bytes:
    """An inner array of a nested one, with its own item type: a MetaValue as read, or a
    numpy array (its dtype) or a list of strings given by a caller."""
    if isinstance(item, MetaValue):
        sub, values = ValueType(item.sub_type), item.value
    elif isinstance(item, np.ndarray):
        sub = next((v for v, dtype in _NUMPY.items() if np.dtype(dtype) == item.dtype), None)
        if sub is None:
            raise ValueError(f"an array of {item.dtype} has no GGUF item type")
        values = item
    elif all(isinstance(s, (str, bytes)) for s in item):
        sub, values = ValueType.STRING, item
    else:
        raise ValueError("an inner array must be read from GGUF, a numpy array or a list of strings")
    return struct.pack("<IQ", sub, len(values)) + _array_items(sub, values)


def encode_value(mv: MetaValue) -> bytes:
    """A metadata value as stored after its key: type tag, then the value."""
    vtype = ValueType(mv.type)
    tag = struct.pack("<I", vtype)
    if vtype == ValueType.STRING:
        return tag + _string(mv.value)
    if vtype == ValueType.ARRAY:
        sub = ValueType(mv.sub_type)
        return tag + struct.pack("<IQ", sub, len(mv.value)) + _array_items(sub, mv.value)
    return tag + struct.pack(_SCALAR_FORMAT[vtype], mv.value)


def _padding(n: int, alignment: int) -> int:
    return -n % alignment


def write_gguf(out: BinaryIO, metadata: Mapping[str, MetaValue], tensors: Sequence[TensorOut]) -> None:
    """Write a whole GGUF file to `out`: metadata in the given order (its general.alignment,
    when present, aligns the data; else 32 bytes), then the tensors in the given order."""
    alignment = int(metadata["general.alignment"].value) if "general.alignment" in metadata \
        else GGUF_DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment = {alignment} is not a power of two")
    parts = [b"GGUF", struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata))]
    for key, mv in metadata.items():
        try:
            parts += [_string(key), encode_value(mv)]
        except (ValueError, TypeError, OverflowError, struct.error) as e:
            raise ValueError(f"metadata {key!r}: {e}") from None
    offset = 0
    for t in tensors:
        parts += [_string(t.name), struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.type, offset)]
        offset += t.data.nbytes + _padding(t.data.nbytes, alignment)
    header = b"".join(parts)
    out.write(header)
    out.write(bytes(_padding(len(header), alignment)))
    for t in tensors:
        out.write(memoryview(t.data).cast("B"))
        out.write(bytes(_padding(t.data.nbytes, alignment)))
