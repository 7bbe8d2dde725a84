"""Reading safetensors files, memory-mapped (the weights of a Hugging Face checkpoint or a
PEFT adapter), and writing them (a PEFT adapter's weights).

The format is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range; an optional `__metadata__`) and the data. It is read here rather than
through the `safetensors` package: that package's numpy API cannot return BF16 tensors (numpy
has no bfloat16), the dtype most checkpoints are published in, and its `deserialize` reads a
whole shard into memory. llama.cpp's gguf-py parses the header itself for the same reason.
Every header is checked (sizes, ranges inside the file, no overlaps) before any byte is used.
The writer is as small (a header and the bytes), so it is here too rather than a dependency.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from llamapy.errors import CheckpointError

from .config import shown
from .json_file import unique_keys

# safetensors dtype -> numpy storage (BF16 as its uint16 bit patterns, ggmlpy's convention)
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_OTHER_DTYPES = {"F64", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL", "F8_E4M3", "F8_E5M2",
                 "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class StTensor:
    """One tensor of a safetensors file: where its bytes are and how to read them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int  # of the first byte, from the start of the file
    nbytes: int
    _map: mmap.mmap | None  # None: a file whose tensors are all empty

    def array(self) -> np.ndarray:
        """The tensor's values, read in place from the map (BF16: uint16 bit patterns)."""
        dtype = DTYPES[self.dtype]
        if self.nbytes == 0:
            return np.zeros(self.shape, dtype)
        return np.frombuffer(self._map, dtype=dtype, count=self.nbytes // dtype.itemsize,
                             offset=self.offset).reshape(self.shape)


def read_safetensors(path: Path) -> list[StTensor]:
    """The tensors of one safetensors file, in the header's order. CheckpointError with one
    line naming the file when it is not a valid safetensors file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (header of {n} bytes in a file of {size})")
            header = _header(path, f.read(n))
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    tensors, ranges = [], []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors.append(_tensor(path, name, entry, data_start, data_size, mapped))
        ranges.append((tensors[-1].offset, tensors[-1].offset + tensors[-1].nbytes, name))
    ranges.sort()
    for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
        if start < end:
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap")
    return tensors


def _header(path: Path, raw: bytes) -> object:
    """The JSON header: refused when it is not UTF-8 JSON, is nested too deeply for Python's
    reader, or names a tensor twice (which entry counts would depend on the reader)."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except RecursionError:
        raise CheckpointError(f"{path}: the safetensors header is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError and a too long number are ValueErrors
        raise CheckpointError(f"{path}: the safetensors header is not JSON ({e})") from None


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _tensor(path: Path, name: str, entry: object, data_start: int, data_size: int,
            mapped: mmap.mmap | None) -> StTensor:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{where}: its header entry lacks dtype, shape or data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not (isinstance(dtype, str) and dtype.isprintable() and len(dtype) <= 16):
        dtype = shown(dtype)
    if dtype not in DTYPES:
        known = "a dtype safetensors knows" if dtype in _OTHER_DTYPES else "not a safetensors dtype"
        raise CheckpointError(f"{where} has dtype {dtype} ({known}); only F32, F16 and BF16 weights "
                              "are converted")
    if (not isinstance(shape, list) or not all(_whole(d) for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(o) for o in offsets)):
        raise CheckpointError(f"{where}: bad shape or data_offsets in the header")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize  # Python's ints: no wrap-around
    if end - begin != nbytes or end > data_size:
        raise CheckpointError(f"{where}: its bytes [{begin}, {end}) do not hold a {dtype} {shape} tensor inside "
                              f"the file's {data_size} data bytes")
    return StTensor(name, dtype, tuple(shape), path, data_start + begin, nbytes, mapped)


def write_safetensors(out: BinaryIO, tensors: list[tuple[str, str, np.ndarray]], metadata: dict[str, str]) -> None:
    """A safetensors file written to `out`: tensors (name, dtype F32/F16/BF16, values stored
    as DTYPES says) in the given order, the header padded with spaces to a multiple of 8
    bytes as the safetensors library pads it (so each tensor starts aligned)."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out.write(struct.pack("<Q", len(raw)) + raw)
    for _, _, data in tensors:
        out.write(np.ascontiguousarray(data).tobytes())
