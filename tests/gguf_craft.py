"""Crafting hostile GGUF files for tests: rewrite a model's metadata and tensors, or patch
the bytes of its header at fields found by a parser of its own (independent of llamapy's,
so a test never trusts the code it tests to find what to damage)."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llamapy.gguf_file import GGUFFile, MetaValue, ValueType
from llamapy.gguf_writer import TensorOut, write_gguf
from llamapy.save import tensor_out

# byte size of each scalar metadata type (gguf_type)
SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def parts(path: Path) -> tuple[dict[str, MetaValue], list[TensorOut]]:
    """A valid file's metadata and tensors, ready to change and `write`."""
    f = GGUFFile(path)
    tensors = [tensor_out(name, t, f.tensor_n_dims[name]) for name, t in f.tensors.items()]
    return dict(f.metadata), tensors


def write(path: Path, meta: dict[str, MetaValue], tensors: list[TensorOut]) -> Path:
    with open(path, "wb") as out:
        write_gguf(out, meta, tensors)
    return path


def u32(v: int) -> MetaValue:
    return MetaValue(ValueType.UINT32, None, v)


def f32(v: float) -> MetaValue:
    return MetaValue(ValueType.FLOAT32, None, v)


def string(v: str) -> MetaValue:
    return MetaValue(ValueType.STRING, None, v)


def tensor(name: str, values: np.ndarray, type_=None, ne: tuple[int, ...] | None = None) -> TensorOut:
    """A tensor of `values` (numpy shape = ne reversed), or of raw bytes with a declared type and ne."""
    if type_ is None:
        from llamapy.gguf_writer import array_out
        return array_out(name, values)
    return TensorOut(name, type_, ne, np.ascontiguousarray(values).reshape(-1).view(np.uint8))


@dataclass
class Field:
    """Where one header value sits: byte position and size (1, 2, 4 or 8 bytes)."""

    pos: int
    size: int
    what: str


@dataclass
class Layout:
    """The positions of a GGUF header's fields."""

    fields: list[Field] = field(default_factory=list)
    kv_values: dict[str, Field] = field(default_factory=dict)        # scalar metadata values by key
    floats: list[Field] = field(default_factory=list)                # every FLOAT32 value (array items too)
    tensor_offsets: dict[str, Field] = field(default_factory=dict)   # tensor offset fields by name
    tensor_dims: dict[str, list[Field]] = field(default_factory=dict)
    tensor_types: dict[str, Field] = field(default_factory=dict)
    kv_end: int = 0       # end of the metadata section (start of the tensor infos)
    infos_end: int = 0    # end of the tensor infos


def layout(data: bytes) -> Layout:
    """Parse a valid GGUF header, recording where every count, type, length and value is."""
    lay = Layout()
    pos = 8
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    lay.fields += [Field(8, 8, "n_tensors"), Field(16, 8, "n_kv")]
    pos = 24

    def string() -> str:
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        lay.fields.append(Field(pos, 8, "string length"))
        s = data[pos + 8:pos + 8 + n].decode("utf-8", "replace")
        pos += 8 + n
        return s

    def value(vtype: int, key: str) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            sub, n = struct.unpack_from("<IQ", data, pos)
            lay.fields += [Field(pos, 4, f"{key} array type"), Field(pos + 4, 8, f"{key} array length")]
            pos += 12
            for _ in range(n):
                value(sub, key)
        else:
            size = SCALAR_SIZE[vtype]
            lay.kv_values.setdefault(key, Field(pos, size, f"{key} value"))
            if vtype == ValueType.FLOAT32:
                lay.floats.append(Field(pos, size, f"{key} float at {pos}"))
            pos += size

    for _ in range(n_kv):
        key = string()
        vtype = struct.unpack_from("<I", data, pos)[0]
        lay.fields.append(Field(pos, 4, f"{key} type"))
        pos += 4
        value(vtype, key)
        if key in lay.kv_values:
            lay.fields.append(lay.kv_values[key])
    lay.kv_end = pos
    for _ in range(n_tensors):
        name = string()
        n_dims = struct.unpack_from("<I", data, pos)[0]
        lay.fields.append(Field(pos, 4, f"{name} n_dims"))
        pos += 4
        lay.tensor_dims[name] = [Field(pos + 8 * i, 8, f"{name} ne[{i}]") for i in range(n_dims)]
        pos += 8 * n_dims
        lay.tensor_types[name] = Field(pos, 4, f"{name} type")
        lay.tensor_offsets[name] = Field(pos + 4, 8, f"{name} offset")
        pos += 12
        lay.fields += lay.tensor_dims[name] + [lay.tensor_types[name], lay.tensor_offsets[name]]
    lay.infos_end = pos
    return lay


def patch(data: bytes, f: Field, value: int) -> bytes:
    """data with the unsigned integer field f set to value (wrapped to its size)."""
    out = bytearray(data)
    struct.pack_into(_UNSIGNED[f.size], out, f.pos, value % (1 << (8 * f.size)))
    return bytes(out)


def read_field(data: bytes, f: Field) -> int:
    return struct.unpack_from(_UNSIGNED[f.size], data, f.pos)[0]


_UNSIGNED = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}


def add_raw_kv(data: bytes, key: str, vtype: int, value: bytes) -> bytes:
    """data (32-byte aligned) with one more key/value pair whose value bytes are given raw
    (what the writer refuses to produce: 5,000 nested arrays, a key twice), the tensors kept."""
    lay = layout(data)
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    kv = struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", vtype) + value
    head = data[:8] + struct.pack("<QQ", n_tensors, n_kv + 1) + data[24:lay.kv_end] + kv
    head += data[lay.kv_end:lay.infos_end]
    head += bytes(-len(head) % 32)
    return head + data[-(-lay.infos_end // 32) * 32:]


def nested_arrays(depth: int) -> bytes:
    """The value bytes of `depth` arrays each holding the next, the innermost empty."""
    return struct.pack("<IQ", ValueType.ARRAY, 1) * depth + struct.pack("<IQ", ValueType.UINT8, 0)
