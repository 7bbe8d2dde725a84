"""Saving a model: a complete GGUF file from the weights in memory, written atomically.

Metadata is copied from the source file byte for byte (every key, its exact GGUF value
type, the original order, arrays of any kind included); tensors are written in the
original order with their current type and shape, from the bytes the model holds NOW
(so weights changed in memory, e.g. by training, are saved). The file goes to a temporary
file in the destination's directory, is fsynced, then renamed over the destination: a
reader never sees a half-written file and a failed save leaves any previous file intact.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValue, GGUFValueType, GGUFWriter

from ggmlpy import Tensor, row_size

from .errors import SaveError
from .model import Model

_ALIGNMENT_KEY = "general.alignment"


class _Encoded:
    """A metadata value already encoded as GGUF bytes (without its type tag)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __len__(self) -> int:  # GGUFWriter.add_array-style checks look at len()
        return len(self.data)


class _ModelWriter(GGUFWriter):
    """GGUFWriter that also writes values copied verbatim from another GGUF file."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None) -> bytes:
        if isinstance(val, _Encoded):
            return (self._pack("I", vtype) if add_vtype else b"") + val.data
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _encoded_field(field: gguf.ReaderField) -> _Encoded:
    """The value bytes of a reader field: parts are [key length, key, type tag, value parts...]."""
    return _Encoded(b"".join(part.tobytes() for part in field.parts[3:]))


def _infer_value(key: str, value: Any, existing: gguf.ReaderField | None) -> GGUFValue:
    """A caller's metadata value, typed like the key it overrides, or inferred for a new key."""
    if isinstance(value, GGUFValue):
        return value
    if existing is not None:
        vtype = existing.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = existing.types[1] if len(existing.types) > 1 else GGUFValueType(int(existing.parts[3][0]))
            return GGUFValue(list(value), vtype, sub)
        return GGUFValue(value, vtype, None)
    if isinstance(value, bool):
        return GGUFValue(value, GGUFValueType.BOOL, None)
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if 0 <= value < 2**32:
            return GGUFValue(value, GGUFValueType.UINT32, None)
        if -(2**31) <= value < 2**31:
            return GGUFValue(value, GGUFValueType.INT32, None)
        return GGUFValue(value, GGUFValueType.INT64 if value < 0 else GGUFValueType.UINT64, None)
    if isinstance(value, (float, np.floating)):
        return GGUFValue(float(value), GGUFValueType.FLOAT32, None)
    if isinstance(value, (str, bytes)):
        return GGUFValue(value, GGUFValueType.STRING, None)
    if isinstance(value, (list, tuple)) and len(value) > 0:
        items = [_infer_value(key, v, None) for v in value]
        sub = items[0].type
        if sub == GGUFValueType.ARRAY or any(it.type != sub for it in items):
            raise SaveError(f"metadata {key!r}: array items must all be numbers, booleans or strings of one kind")
        return GGUFValue([it.value for it in items], GGUFValueType.ARRAY, sub)
    raise SaveError(f"metadata {key!r}: cannot store a value of type {type(value).__name__} in GGUF")


def _tensor_bytes(t: Tensor) -> np.ndarray:
    """The tensor's current bytes, packed row after row (no copy when already contiguous)."""
    if not t.has_data:
        raise SaveError(f"tensor {t.name!r} has no data")
    return np.ascontiguousarray(t.array()).reshape(-1).view(np.uint8)


def _fill_writer(writer: _ModelWriter, model: Model, metadata: Mapping[str, Any] | None) -> None:
    reader = model.file.reader
    if reader.byte_order != "I" and reader.byte_order != "=":
        # raw metadata bytes would carry the source's byte order into a little-endian file
        raise SaveError(f"{model.path}: saving a model read from a big-endian GGUF file is not supported")
    overrides = dict(metadata or {})
    # GGUFWriter puts general.architecture first; keep the source's order instead
    writer.kv_data = [{}]
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's virtual header fields (version, counts)
        if key in overrides:
            v = _infer_value(key, overrides.pop(key), field)
            writer.add_key_value(key, v.value, v.type, v.sub_type)
        else:
            vtype = field.types[0]
            writer.add_key_value(key, _encoded_field(field), vtype)
    for key, value in overrides.items():
        v = _infer_value(key, value, None)
        writer.add_key_value(key, v.value, v.type, v.sub_type)
    alignment = writer.kv_data[0].get(_ALIGNMENT_KEY)
    if alignment is not None:
        align = int(reader.fields[_ALIGNMENT_KEY].parts[-1][0]) if isinstance(alignment.value, _Encoded) else int(alignment.value)
        if align <= 0 or align & (align - 1):
            raise SaveError(f"{_ALIGNMENT_KEY} = {align} is not a power of two")
        writer.data_alignment = align

    n_dims_in_file = {rt.name: len(rt.shape) for rt in reader.tensors}
    for name, t in model.tensors.items():
        try:
            qtype = GGMLQuantizationType(int(t.type))
        except ValueError:
            raise SaveError(f"tensor {name!r}: type {t.type.name} has no GGUF equivalent") from None
        n_dims = max(n_dims_in_file.get(name, t.n_dims()), t.n_dims())
        data = _tensor_bytes(t)
        # shape in numpy order, last dimension in bytes: GGUFWriter turns it back into elements
        byte_shape = (*t.ne[1:n_dims][::-1], row_size(t.type, t.ne[0]))
        writer.add_tensor(name, data, raw_shape=byte_shape, raw_dtype=qtype)


def save_model_to_file(model: Model, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write `model` as a complete GGUF file at `path`, atomically; returns the path.

    Every metadata key of the source file is copied with its exact type and in its order;
    `metadata` adds keys or overrides values (typed like the key it replaces; new ints are
    UINT32, floats FLOAT32; pass a `gguf.GGUFValue` to choose the type). Every tensor is
    written from its current in-memory bytes. Raises `SaveError` with one clear line
    (the destination is then untouched: a previous file there stays as it was).
    """
    dest = Path(path)
    writer = _ModelWriter(None, str(model.file.get("general.architecture", "")))
    _fill_writer(writer, model, metadata)
    return write_atomically(writer, dest, "model")


def write_atomically(writer: GGUFWriter, dest: Path, what: str) -> Path:
    """Write a filled GGUFWriter to a temp file next to `dest`, fsync, rename over `dest`."""
    if dest.is_dir():
        raise SaveError(f"cannot save {what} to {dest}: it is a directory")
    tmp: Path | None = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        os.chmod(tmp, 0o644)
        writer.open_output_file(tmp)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.flush()
        assert writer.fout is not None
        os.fsync(writer.fout[0].fileno())
        writer.close()
        os.replace(tmp, dest)
        tmp = None
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SaveError(f"cannot save {what} to {dest}: {reason}") from None
    finally:
        writer.close()
        if tmp is not None:
            try:
                tmp.unlink()
            except OSError:
                pass
    _fsync_dir(dest.parent)
    return dest


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
