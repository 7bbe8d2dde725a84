"""Opening GGUF files: metadata and memory-mapped tensors, with one clear error per failure.

The header and key/value section are parsed here rather than by `gguf.GGUFReader`,
which builds a numpy view for every string of a token list (12-17 s for a 262,144-token
vocabulary); this reader decodes the same section in a fraction of a second. The
`gguf` package's reader is still available as `GGUFFile.reader`, built on first use.
Saving (gguf_writer.py) writes the metadata decoded here back with the same types (strings
keep their bytes via surrogateescape).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from ggmlpy import GGMLType, Tensor

from .errors import ModelLoadError, UnsupportedModelError

GGUF_DEFAULT_ALIGNMENT = 32


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
    string arrays are lists of str (bytes that are not UTF-8 kept via surrogateescape);
    arrays of arrays are lists of MetaValue (each inner array keeps its own item type).
    """

    type: ValueType
    sub_type: ValueType | None
    value: Any


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]
    type: int
    offset: int  # from the start of the data section


class _Parser:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path} is damaged or truncated (header runs past the end of the file)")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string_bytes(self) -> bytes:
        n = self.unpack("<Q")
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def string(self) -> str:
        return self.string_bytes().decode("utf-8", "surrogateescape")

    def value(self, vtype: int) -> MetaValue:
        try:
            vtype = ValueType(vtype)
        except ValueError:
            raise ModelLoadError(f"{self.path} is damaged (unknown metadata value type {vtype})") from None
        if vtype == ValueType.STRING:
            return MetaValue(vtype, None, self.string())
        if vtype == ValueType.ARRAY:
            sub, n = self.unpack("<IQ")
            try:
                sub = ValueType(sub)
            except ValueError:
                raise ModelLoadError(f"{self.path} is damaged (unknown array element type {sub})") from None
            if sub == ValueType.STRING:
                return MetaValue(vtype, sub, self.string_array(n))
            if sub == ValueType.ARRAY:
                return MetaValue(vtype, sub, [self.value(ValueType.ARRAY) for _ in range(n)])
            dtype = np.dtype(_NUMPY[sub]).newbyteorder("<")
            self.need(n * dtype.itemsize)
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
            self.pos += n * dtype.itemsize
            return MetaValue(vtype, sub, arr)
        dtype = np.dtype(_NUMPY[vtype]).newbyteorder("<")
        self.need(dtype.itemsize)
        v = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)[0].item()
        self.pos += dtype.itemsize
        return MetaValue(vtype, None, v)

    def string_array(self, n: int) -> list[str]:
        """n length-prefixed strings; one pass of slicing, the one hot loop of loading."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        out: list[str] = []
        append = out.append
        frombytes = int.from_bytes
        for _ in range(n):
            if pos + 8 > end:
                raise ModelLoadError(f"{self.path} is damaged or truncated (string array runs past the end)")
            length = frombytes(buf[pos:pos + 8], "little")
            pos += 8
            if pos + length > end:
                raise ModelLoadError(f"{self.path} is damaged or truncated (string array runs past the end)")
            append(str(buf[pos:pos + length], "utf-8", "surrogateescape"))
            pos += length
        self.pos = pos
        return out


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
    if n_kv > len(p.buf) or n_tensors > len(p.buf):
        raise ModelLoadError(f"{path} is damaged (implausible counts: {n_tensors} tensors, {n_kv} keys)")
    meta: dict[str, MetaValue] = {}
    for _ in range(n_kv):
        key = p.string()
        meta[key] = p.value(p.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = p.string()
        n_dims = p.unpack("<I")
        if n_dims > 4:
            raise ModelLoadError(f"{path} is damaged (tensor {name} has {n_dims} dimensions)")
        ne = tuple(p.unpack(f"<{n_dims}Q")) if n_dims > 1 else ((p.unpack("<Q"),) if n_dims == 1 else ())
        ttype, offset = p.unpack("<IQ")
        infos.append(TensorInfo(name, ne, ttype, offset))
    align_v = meta.get("general.alignment")
    align = int(align_v.value) if align_v is not None else GGUF_DEFAULT_ALIGNMENT
    if align <= 0 or align & (align - 1):
        raise ModelLoadError(f"{path}: general.alignment {align} is not a power of two")
    data_start = -(-p.pos // align) * align
    return version, meta, infos, data_start


def metadata_from_reader(reader) -> dict[str, MetaValue]:
    """The same metadata dictionary from a `gguf.GGUFReader` (for callers that hold one),
    parsed from the bytes it maps, so both sources give identical values."""
    return read_gguf_header(np.asarray(reader.data), Path(getattr(reader.data, "filename", None) or "<gguf>"))[1]


class GGUFMetadata:
    """What a model's description offers, wherever it lives: metadata by key, tensors by name,
    and each tensor's dimension count as stored. A GGUF file (`GGUFFile`) and a model built
    in memory (`InMemoryGGUF`) share it, so loading, hyper-parameters and saving read both alike."""

    path: Path
    metadata: dict[str, MetaValue]
    tensors: dict[str, Tensor]
    tensor_n_dims: dict[str, int]  # dimensions as written (a 2-d tensor may end in a 1)

    def has(self, key: str) -> bool:
        return key in self.metadata

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (numeric arrays as lists), or `default` when the key is absent."""
        v = self.metadata.get(key)
        if v is None:
            return default
        return v.value.tolist() if isinstance(v.value, np.ndarray) else v.value

    def require(self, key: str) -> Any:
        if not self.has(key):
            raise UnsupportedModelError(f"{self.path}: required metadata key {key!r} is missing")
        return self.get(key)

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
        file_size = self.data.nbytes
        for info in infos:
            try:
                ggml_type = GGMLType(info.type)
            except ValueError:
                raise UnsupportedModelError(f"{self.path}: tensor {info.name} has unknown type {info.type}") from None
            ne = info.ne + (1,) * (4 - len(info.ne))
            tensor = Tensor(ggml_type, ne, name=info.name)
            offset = data_start + info.offset
            if offset + tensor.nbytes() > file_size:
                raise ModelLoadError(f"{self.path} is truncated: tensor {info.name} extends past the end of the file")
            if info.name in self.tensors:
                raise ModelLoadError(f"{self.path} is damaged: tensor {info.name} appears twice")
            tensor.bind(self.data, offset)
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
