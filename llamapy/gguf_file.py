"""Opening GGUF files: metadata and memory-mapped tensors, with one clear error per failure.

The header and key/value section are parsed here rather than by `gguf.GGUFReader`,
which builds a numpy view for every string of a token list (12-17 s for a 262,144-token
vocabulary); this reader decodes the same section in a fraction of a second. The
`gguf` package's reader is still available as `GGUFFile.reader`, built on first use.
Saving (gguf_writer.py) writes the metadata decoded here back with the same types (strings
keep their bytes via surrogateescape).

A file is never trusted: every count and length is checked against the bytes left before
anything is read or allocated from it, arrays nest at most MAX_ARRAY_DEPTH deep, and the
tensors must tile the data section (`_check_layout`), so no tensor is ever a view past the
file, onto another tensor's bytes, or onto bytes written as another type. What the
metadata means (hyper-parameters, shapes) is checked where it is read (hparams.py, model.py).
"""
from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from ggmlpy import GGMLType, Tensor, traits

from .errors import ModelLoadError, UnsupportedModelError

GGUF_DEFAULT_ALIGNMENT = 32
FLOAT32_MAX = float(np.finfo(np.float32).max)


class ValueType(IntEnum):
    """GGUF metadata value types (gguf_type)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_NUMPY = {
    ValueType.UINT8: np.uint8, ValueType.INT8: np.int8, ValueType.UINT16: np.uint16, ValueType.INT16: np.int16,
    ValueType.UINT32: np.uint32, ValueType.INT32: np.int32, ValueType.FLOAT32: np.float32,
    ValueType.BOOL: np.bool_, ValueType.UINT64: np.uint64, ValueType.INT64: np.int64,
    ValueType.FLOAT64: np.float64,
}


@dataclass(frozen=True)
class MetaValue:
    """One metadata value: its type, the element type of an array, and the decoded value.

    Scalars are Python numbers, booleans or strings; numeric arrays are numpy arrays;
    string arrays are read as StringArray (a sequence of str, bytes that are not UTF-8 kept via
    surrogateescape) and may be given as lists;
    arrays of arrays are lists of MetaValue (each inner array keeps its own item type).
    """

    type: ValueType
    sub_type: ValueType | None
    value: Any


def _decode_strings(raw: bytes, n: int) -> list[str]:
    """The n length-prefixed strings of `raw` (UTF-8, bad bytes as lone surrogates). One walk
    over the prefixes, then one decode of all texts joined by NULs and one split: a
    262,144-token vocabulary in ~0.15 s rather than 0.6. UTF-8 resynchronises at a NUL, so
    this equals decoding each text alone; a text that itself holds a NUL takes the slow way."""
    length_at = struct.Struct("<Q").unpack_from
    starts, pos = [], 0
    for _ in range(n):
        starts.append(pos)
        pos += 8 + length_at(raw, pos)[0]
    if n == 0:
        return []
    first = np.asarray(starts, np.int64)
    keep = np.ones(len(raw), bool)
    keep[(first[:, None] + np.arange(7)).ravel()] = False  # each prefix's 8th byte stays, as the separator
    joined = np.frombuffer(raw, np.uint8)[keep]
    joined[first - 7 * np.arange(n)] = 0
    if len(joined) - np.count_nonzero(joined) == n:  # no NUL inside a text
        return bytes(joined[1:]).decode("utf-8", "surrogateescape").split("\x00")
    items = []
    for start in starts:
        length = length_at(raw, start)[0]
        items.append(str(raw[start + 8:start + 8 + length], "utf-8", "surrogateescape"))
    return items


class StringArray(Sequence[str]):
    """A metadata array of strings as a file stores them (each a little-endian uint64 length,
    then its bytes), decoded on the first use of an item. A file written from it copies the
    bytes back, so a 262,144-token vocabulary that a tool only passes on (llamapy-quantize) is
    read and written in milliseconds. Immutable: a changed list is a new list or StringArray."""

    __slots__ = ("raw", "_n", "_items")

    def __init__(self, raw: bytes, n: int) -> None:
        self.raw = raw
        self._n = n
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:
            self._items = _decode_strings(self.raw, self._n)
        return self._items

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._decoded()[i]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self._n == other._n and self.raw == other.raw
        if isinstance(other, (list, tuple)):
            return self._decoded() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the list it stands for

    def tolist(self) -> list[str]:
        """The items as a new list (the numpy arrays of numeric values have the same method)."""
        return list(self._decoded())

    def __repr__(self) -> str:
        return f"StringArray({self._n} strings, {len(self.raw)} bytes)"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]
    type: int
    offset: int  # from the start of the data section


# What a file's header may hold, bounded before anything is allocated from it.
MAX_ARRAY_DEPTH = 4        # arrays of arrays of ... (llama.cpp's reader refuses any; gguf-py writes one level)
MAX_TENSOR_DIMS = 4
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_MIN_ITEM_BYTES = {ValueType.STRING: 8, ValueType.ARRAY: 12}  # length prefix; item type + count


class _Parser:
    """Reads a GGUF header; every count and length is checked against the bytes left in the
    file before anything is read or allocated from it."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str = "header") -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path} is damaged or truncated ({what} runs past the end of the file)")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string_bytes(self) -> bytes:
        n = self.unpack("<Q")
        self.need(n, "a string")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def string(self) -> str:
        return self.string_bytes().decode("utf-8", "surrogateescape")

    def value(self, vtype: int, key: str, depth: int = 0) -> MetaValue:
        try:
            vtype = ValueType(vtype)
        except ValueError:
            raise ModelLoadError(f"{self.path} is damaged (metadata {key!r}: unknown value type {vtype})") from None
        if vtype == ValueType.STRING:
            return MetaValue(vtype, None, self.string())
        if vtype == ValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ModelLoadError(f"{self.path} is damaged (metadata {key!r}: arrays nested deeper than "
                                     f"{MAX_ARRAY_DEPTH} levels)")
            sub, n = self.unpack("<IQ")
            try:
                sub = ValueType(sub)
            except ValueError:
                raise ModelLoadError(f"{self.path} is damaged (metadata {key!r}: unknown array item type {sub})") from None
            item_bytes = _MIN_ITEM_BYTES.get(sub) or np.dtype(_NUMPY[sub]).itemsize
            self.need(n * item_bytes, f"metadata {key!r}'s {n} items")  # before a list or array of n is made
            if sub == ValueType.STRING:
                return MetaValue(vtype, sub, self.string_array(n))
            if sub == ValueType.ARRAY:
                return MetaValue(vtype, sub, [self.value(ValueType.ARRAY, key, depth + 1) for _ in range(n)])
            dtype = np.dtype(_NUMPY[sub]).newbyteorder("<")
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
            self.pos += n * dtype.itemsize
            return MetaValue(vtype, sub, arr)
        dtype = np.dtype(_NUMPY[vtype]).newbyteorder("<")
        self.need(dtype.itemsize)
        v = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)[0].item()
        self.pos += dtype.itemsize
        return MetaValue(vtype, None, v)

    def string_array(self, n: int) -> StringArray:
        """n length-prefixed strings, kept as their bytes: one pass over the length prefixes (the
        one hot loop of loading), the decoding left to the first use of an item."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length_at = struct.Struct("<Q").unpack_from
        start = pos
        for _ in range(n):
            if pos + 8 > end:
                raise ModelLoadError(f"{self.path} is damaged or truncated (string array runs past the end)")
            pos += 8 + length_at(buf, pos)[0]
        if pos > end:
            raise ModelLoadError(f"{self.path} is damaged or truncated (string array runs past the end)")
        self.pos = pos
        return StringArray(bytes(buf[start:pos]), n)

    def tensor_info(self) -> TensorInfo:
        name = self.string()
        n_dims = self.unpack("<I")
        if n_dims > MAX_TENSOR_DIMS:
            raise ModelLoadError(f"{self.path} is damaged (tensor {name!r} has {n_dims} dimensions)")
        ne = tuple(self.unpack(f"<{n_dims}q")) if n_dims > 1 else ((self.unpack("<q"),) if n_dims == 1 else ())
        if any(n < 0 for n in ne):
            raise ModelLoadError(f"{self.path} is damaged (tensor {name!r} has a negative dimension: {ne})")
        ttype, offset = self.unpack("<IQ")
        return TensorInfo(name, ne, ttype, offset)


def read_gguf_header(data: np.ndarray, path: Path) -> tuple[int, dict[str, MetaValue], list[TensorInfo], int]:
    """(version, metadata, tensor infos, data section offset) of the GGUF bytes `data`."""
    p = _Parser(memoryview(data).cast("B"), path)
    magic = bytes(p.buf[:4]) if len(p.buf) >= 4 else b""
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic {magic!r})")
    p.pos = 4
    version = p.unpack("<I")
    if version & 0xFFFF == 0 and version != 0:
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = p.unpack("<QQ")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_INFO_BYTES > len(p.buf) - p.pos:
        raise ModelLoadError(f"{path} is damaged (implausible counts: {n_tensors} tensors, {n_kv} keys "
                             f"in {len(p.buf)} bytes)")
    meta: dict[str, MetaValue] = {}
    for _ in range(n_kv):
        key = p.string()
        if key in meta:
            raise ModelLoadError(f"{path} is damaged (metadata key {key!r} appears twice)")
        meta[key] = p.value(p.unpack("<I"), key)
    infos = [p.tensor_info() for _ in range(n_tensors)]
    align_v = meta.get("general.alignment")
    if align_v is not None and align_v.type != ValueType.UINT32:  # as llama.cpp's gguf reader
        raise ModelLoadError(f"{path}: general.alignment is {type_name(align_v)}, expected UINT32")
    align = align_v.value if align_v is not None else GGUF_DEFAULT_ALIGNMENT
    if align <= 0 or align & (align - 1):
        raise ModelLoadError(f"{path}: general.alignment {align} is not a power of two")
    data_start = _padded(p.pos, align)
    _check_layout(infos, data_start, align, len(p.buf), path)
    return version, meta, infos, data_start


def _nbytes(info: TensorInfo, path: Path) -> int:
    """Bytes of a tensor as described (Python integers: no overflow whatever the dimensions)."""
    try:
        tr = traits(GGMLType(info.type))
    except (ValueError, NotImplementedError):
        raise UnsupportedModelError(f"{path}: tensor {info.name!r} has unknown type {info.type}") from None
    ne = info.ne + (1,) * (MAX_TENSOR_DIMS - len(info.ne))
    if ne[0] % tr.blck_size:
        raise ModelLoadError(f"{path} is damaged: tensor {info.name!r} has rows of {ne[0]} {tr.name} values, "
                             f"not a multiple of its block size {tr.blck_size}")
    return ne[0] // tr.blck_size * tr.type_size * ne[1] * ne[2] * ne[3]


def _check_layout(infos: list[TensorInfo], data_start: int, align: int, file_size: int, path: Path) -> None:
    """The tensors' bytes tile the data section: each inside the file, at an aligned offset,
    starting where another one's bytes end (padded to the alignment) or at 0, sharing none,
    the last one ending the file (before its padding). llama.cpp's writers lay files out so
    and its reader asks as much: a tensor whose type or dimensions were changed leaves a gap
    or an overlap, so its bytes are never read as another type."""
    spans = []
    names: set[str] = set()
    for info in infos:
        if info.name in names:
            raise ModelLoadError(f"{path} is damaged: tensor {info.name!r} appears twice")
        names.add(info.name)
        nbytes = _nbytes(info, path)
        if info.offset % align:
            raise ModelLoadError(f"{path} is damaged: the offset {info.offset} of tensor {info.name!r} is not a "
                                 f"multiple of the alignment {align}")
        if data_start + info.offset + nbytes > file_size:
            raise ModelLoadError(f"{path} is truncated or damaged: tensor {info.name!r} ({nbytes} bytes at data "
                                 f"offset {info.offset}) extends past the end of the file")
        spans.append((info.offset, info.offset + nbytes, info.name))
    spans.sort()
    end, before = 0, None
    for start, stop, name in spans:
        if start < end:
            raise ModelLoadError(f"{path} is damaged: tensors {before!r} and {name!r} share bytes")
        if start != _padded(end, align):
            raise ModelLoadError(f"{path} is damaged: {start - end} bytes before tensor {name!r} belong to no tensor "
                                 "(a tensor's type or dimensions do not match its bytes)")
        end, before = stop, name
    if spans and file_size - data_start > _padded(end, align):
        raise ModelLoadError(f"{path} is damaged: {file_size - data_start - end} bytes after tensor {before!r} belong "
                             "to no tensor (a tensor's type or dimensions do not match its bytes)")


def _padded(n: int, align: int) -> int:
    return -(-n // align) * align


def metadata_from_reader(reader) -> dict[str, MetaValue]:
    """The same metadata dictionary from a `gguf.GGUFReader` (for callers that hold one),
    parsed from the bytes it maps, so both sources give identical values."""
    return read_gguf_header(np.asarray(reader.data), Path(getattr(reader.data, "filename", None) or "<gguf>"))[1]


_INTEGERS = frozenset({ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32,
                       ValueType.INT32, ValueType.UINT64, ValueType.INT64})
_STORED_AS: dict[type, tuple[frozenset[ValueType], str]] = {  # what a key read as int, float, ... may hold
    int: (_INTEGERS, "an integer"),
    float: (_INTEGERS | {ValueType.FLOAT32, ValueType.FLOAT64}, "a number"),
    bool: (frozenset({ValueType.BOOL}), "a boolean"),
    str: (frozenset({ValueType.STRING}), "a string"),
}
INT32_MAX = 2**31 - 1  # sizes and counts reach ggml's int32 op parameters


def type_name(v: MetaValue) -> str:
    return f"an ARRAY of {v.sub_type.name}" if v.type == ValueType.ARRAY else f"a {v.type.name}"


def typed_scalar(metadata: Mapping[str, MetaValue], key: str, kind: type, where: Path | None = None) -> Any:
    """The value of `key` as `kind` (int, float, bool or str), None when absent; one line naming
    the key (and the file `where`) when the file stores another type (llama.cpp's loader
    checks each key's type too)."""
    v = metadata.get(key)
    if v is None:
        return None
    types, expected = _STORED_AS[kind]
    if v.type not in types:
        raise ModelLoadError(f"{f'{where}: ' if where else ''}metadata {key} is {type_name(v)}, expected {expected}")
    return kind(v.value)


_REQUIRED: Any = object()


class GGUFMetadata:
    """What a model's description offers, wherever it lives: metadata by key, tensors by name,
    and each tensor's dimension count as stored. A GGUF file (`GGUFFile`) and a model built
    in memory (`InMemoryGGUF`) share it, so loading, hyper-parameters and saving read both alike.

    The typed getters (`get_int`, `get_float`, `get_str`, `get_bool`) are how llamapy reads the
    keys it uses: a value of another type, out of range or not finite is one clear line, never
    a number that crashes or poisons a computation later. Without a default a key is required."""

    path: Path
    metadata: dict[str, MetaValue]
    tensors: dict[str, Tensor]
    tensor_n_dims: dict[str, int]  # dimensions as written (a 2-d tensor may end in a 1)

    def has(self, key: str) -> bool:
        return key in self.metadata

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as stored, whatever its type (numeric arrays as lists), or `default`."""
        v = self.metadata.get(key)
        if v is None:
            return default
        return v.value.tolist() if isinstance(v.value, np.ndarray) else v.value

    def _typed(self, key: str, kind: type, default: Any) -> Any:
        value = typed_scalar(self.metadata, key, kind, self.path)
        if value is not None:
            return value
        if default is _REQUIRED:
            raise UnsupportedModelError(f"{self.path}: required metadata key {key!r} is missing")
        return default

    def _out_of_range(self, key: str, value: Any, rule: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: metadata {key} = {value!r} is out of range ({rule})")

    def get_int(self, key: str, default: int = _REQUIRED, *, at_least: int = 0, at_most: int = INT32_MAX) -> int:
        value = self._typed(key, int, default)
        if not at_least <= value <= at_most:
            raise self._out_of_range(key, value, f"must be in {at_least}..{at_most}")
        return value

    def get_float(self, key: str, default: float = _REQUIRED, *, at_least: float | None = None,
                  above: float | None = None) -> float:
        """A finite number (float32's range: ggml computes with float32)."""
        value = self._typed(key, float, default)
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise self._out_of_range(key, value, "must be a finite float32")
        if at_least is not None and value < at_least:
            raise self._out_of_range(key, value, f"must be at least {at_least}")
        if above is not None and value <= above:
            raise self._out_of_range(key, value, f"must be above {above}")
        return value

    def get_str(self, key: str, default: str | None = _REQUIRED) -> str | None:
        return self._typed(key, str, default)

    def get_bool(self, key: str, default: bool = _REQUIRED) -> bool:
        return self._typed(key, bool, default)

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise UnsupportedModelError(f"{self.path}: required tensor {name!r} is missing") from None


class InMemoryGGUF(GGUFMetadata):
    """A GGUF description held in memory: the metadata and tensors of a model built in Python
    (llamapy.new_model), with nothing on disk until it is saved. `label` stands in for a file
    path in messages; `tensor_n_dims` gives the dimensions to write where a tensor's shape
    ends in 1s that belong to it (default: up to its last dimension above 1)."""

    def __init__(self, label: str, metadata: dict[str, MetaValue], tensors: dict[str, Tensor],
                 tensor_n_dims: dict[str, int] | None = None) -> None:
        self.path = Path(label)
        self.version = 3
        self.metadata = dict(metadata)
        self.tensors = dict(tensors)
        self.tensor_n_dims = {name: t.n_dims() for name, t in self.tensors.items()}
        self.tensor_n_dims.update(tensor_n_dims or {})


class GGUFFile(GGUFMetadata):
    """A GGUF file's key/value metadata and its tensors, bound to the memory-mapped bytes."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ModelLoadError(f"cannot read {self.path}: {e.strerror}") from None
        if magic != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (bad magic {magic!r})")
        try:
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot map {self.path}: {e}") from None
        self.version, self.metadata, infos, data_start = read_gguf_header(self.data, self.path)
        self._reader = None
        self.tensors: dict[str, Tensor] = {}
        self.tensor_n_dims = {info.name: len(info.ne) for info in infos}
        for info in infos:  # read_gguf_header checked each one's type, size and place in the file
            tensor = Tensor(GGMLType(info.type), info.ne + (1,) * (MAX_TENSOR_DIMS - len(info.ne)), name=info.name)
            tensor.bind(self.data, data_start + info.offset)
            self.tensors[info.name] = tensor

    @property
    def reader(self):
        """The `gguf` package's reader of the same file (slow on large vocabularies; built on demand)."""
        if self._reader is None:
            import gguf
            self._reader = gguf.GGUFReader(self.path, "r")
        return self._reader

    @property
    def mapped_bytes(self) -> np.ndarray:
        return self.data
