"""Saving a model: a complete GGUF file from the weights in memory, written atomically.

Metadata is copied from the model's description (the GGUF file it was loaded from, or the
in-memory one of a model built by `new_model`) value for value through gguf's public writer
API (every key, its exact GGUF value type, the original order, strings as raw bytes); tensors are written in the
original order with their current type and shape, from the bytes the model holds NOW
(so weights changed in memory, e.g. by training, are saved). The file goes to a temporary
file in the destination's directory, is fsynced, then renamed over the destination: a
reader never sees a half-written file and a failed save leaves any previous file intact.

gguf is imported when a file is written, not with this module: importing it (with yaml and
the rest of its package) costs a training process 3 MB, and a run saves once, at its end.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ggmlpy import Tensor, row_size

from .errors import SaveError
from .gguf_file import MetaValue
from .model import Model

_ALIGNMENT_KEY = "general.alignment"


# The inner arrays gguf's writer types exactly: it infers an inner array's item type from
# its Python values (int -> INT32, float -> FLOAT32, bool, str/bytes -> STRING).
_NESTABLE = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.bool_))


def _raw(text: str) -> bytes:
    """A metadata string's original bytes (the reader kept non-UTF-8 bytes via surrogateescape)."""
    return text.encode("utf-8", "surrogateescape")


def _gguf_value(key: str, mv: MetaValue) -> GGUFValue:
    """A metadata value with its exact GGUF type, for gguf's writer; strings go as bytes, so a
    vocabulary's tokens are copied as they are even where not valid UTF-8."""
    from gguf import GGUFValue, GGUFValueType
    vtype = GGUFValueType(int(mv.type))
    if vtype == GGUFValueType.STRING:
        return GGUFValue(_raw(mv.value), vtype, None)
    if vtype != GGUFValueType.ARRAY:
        return GGUFValue(mv.value, vtype, None)
    if len(mv.value) == 0:
        raise SaveError(f"metadata {key!r}: an empty array cannot be saved with gguf's writer")
    sub = GGUFValueType(int(mv.sub_type))
    if sub == GGUFValueType.STRING:
        return GGUFValue([_raw(s) for s in mv.value], vtype, sub)
    if sub != GGUFValueType.ARRAY:
        return GGUFValue(mv.value.tolist(), vtype, sub)
    return GGUFValue([_nested_item(key, item) for item in mv.value], vtype, sub)


def _nested_item(key: str, item: Any) -> list:
    """An inner array of a nested one (a numpy array, a list of str, or a list of arrays) as
    the Python list gguf's writer will type; refused when it would change the item type."""
    if isinstance(item, np.ndarray):
        if item.dtype not in _NESTABLE:
            raise SaveError(f"metadata {key!r}: gguf's writer can nest only arrays of int32, float32, bool or string")
        values = item.tolist()
    elif item and isinstance(item[0], str):
        values = [_raw(s) for s in item]
    else:
        values = [_nested_item(key, x) for x in item]
    if not values:
        raise SaveError(f"metadata {key!r}: an empty array cannot be saved with gguf's writer")
    return values


def _infer_value(key: str, value: Any, existing: MetaValue | None) -> GGUFValue:
    """A caller's metadata value, typed like the key it overrides, or inferred for a new key."""
    from gguf import GGUFValue, GGUFValueType
    if isinstance(value, GGUFValue):
        return value
    if existing is not None:
        vtype = GGUFValueType(int(existing.type))
        if vtype == GGUFValueType.ARRAY:
            return GGUFValue(list(value), vtype, GGUFValueType(int(existing.sub_type)))
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


def _fill_writer(writer: GGUFWriter, model: Model, metadata: Mapping[str, Any] | None) -> None:
    from gguf import GGMLQuantizationType

    source = model.file  # a GGUFFile, or the in-memory description of a model built in Python
    overrides = dict(metadata or {})
    # GGUFWriter puts general.architecture first; keep the source's order instead
    writer.kv_data = [{}]
    for key, mv in source.metadata.items():
        v = _infer_value(key, overrides.pop(key), mv) if key in overrides else _gguf_value(key, mv)
        writer.add_key_value(key, v.value, v.type, v.sub_type)
    for key, value in overrides.items():
        v = _infer_value(key, value, None)
        writer.add_key_value(key, v.value, v.type, v.sub_type)
    alignment = writer.kv_data[0].get(_ALIGNMENT_KEY)
    if alignment is not None:
        align = int(alignment.value)
        if align <= 0 or align & (align - 1):
            raise SaveError(f"{_ALIGNMENT_KEY} = {align} is not a power of two")
        writer.data_alignment = align

    n_dims_in_file = source.tensor_n_dims
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
    from gguf import GGUFWriter
    dest = Path(path)
    writer = GGUFWriter(None, str(model.file.get("general.architecture", "")))
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
