"""Saving a model: a complete GGUF file from the weights in memory, written atomically.

Metadata is copied from the model's description (the GGUF file it was loaded from, or the
in-memory one of a model built by `new_model`) value for value (every key, its exact GGUF
value type, the original order, strings as raw bytes); tensors are written in the original
order with their current type and shape, from the bytes the model holds NOW (so weights
changed in memory, e.g. by training, are saved). The file goes to a temporary file in the
destination's directory, is fsynced, read back (llamapy.read_back: a model through the
model loader's structural checks, any other GGUF through the GGUF reader), then renamed over
the destination: a reader never sees a half-written file, no save ends with a file llamapy
cannot load, and a failed save leaves any previous file intact. Adapters, checkpoints and
converted models are written the same way (`write_atomically`).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ggmlpy import Tensor

from .atomic import replace_atomically
from .errors import SaveError
from .gguf_file import MetaValue, ValueType
from .gguf_writer import TensorOut, write_gguf
from .model import Model
from .read_back import read_back_gguf, read_back_model, read_back_written


def _typed_value(key: str, value: Any, existing: MetaValue | None) -> MetaValue:
    """A caller's metadata value, typed like the key it overrides, or inferred for a new key."""
    if all(hasattr(value, a) for a in ("type", "sub_type", "value")):  # a MetaValue, or gguf's GGUFValue
        sub = None if value.sub_type is None else ValueType(int(value.sub_type))
        return MetaValue(ValueType(int(value.type)), sub, value.value)
    if existing is not None:
        if existing.type == ValueType.ARRAY:
            return MetaValue(ValueType.ARRAY, existing.sub_type, list(value))
        return MetaValue(existing.type, None, value)
    if isinstance(value, bool):
        return MetaValue(ValueType.BOOL, None, value)
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if 0 <= value < 2**32:
            return MetaValue(ValueType.UINT32, None, value)
        if -(2**31) <= value < 2**31:
            return MetaValue(ValueType.INT32, None, value)
        return MetaValue(ValueType.INT64 if value < 0 else ValueType.UINT64, None, value)
    if isinstance(value, (float, np.floating)):
        return MetaValue(ValueType.FLOAT32, None, float(value))
    if isinstance(value, (str, bytes)):
        return MetaValue(ValueType.STRING, None, value)
    if isinstance(value, (list, tuple)) and len(value) > 0:
        items = [_typed_value(key, v, None) for v in value]
        sub = items[0].type
        if sub == ValueType.ARRAY or any(it.type != sub for it in items):
            raise SaveError(f"metadata {key!r}: array items must all be numbers, booleans or strings of one kind")
        return MetaValue(ValueType.ARRAY, sub, [it.value for it in items])
    raise SaveError(f"metadata {key!r}: cannot store a value of type {type(value).__name__} in GGUF")


def metadata_to_save(source: Mapping[str, MetaValue], overrides: Mapping[str, Any] | None) -> dict[str, MetaValue]:
    """The source's metadata in its order, with the caller's values replacing or following it."""
    overrides = dict(overrides or {})
    meta = {key: _typed_value(key, overrides.pop(key), mv) if key in overrides else mv
            for key, mv in source.items()}
    meta.update((key, _typed_value(key, value, None)) for key, value in overrides.items())
    return meta


def tensor_out(name: str, t: Tensor, n_dims: int | None = None) -> TensorOut:
    """What the writer needs of a tensor: its current bytes, packed row after row (no copy
    when already contiguous), and `n_dims` of its dimensions (a 2-d tensor may end in a 1)."""
    if not t.has_data:
        raise SaveError(f"tensor {name!r} has no data")
    n_dims = max(n_dims or 0, t.n_dims())
    return TensorOut(name, t.type, tuple(t.ne[:n_dims]), np.ascontiguousarray(t.array()).reshape(-1).view(np.uint8))


def save_model_to_file(model: Model, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write `model` as a complete GGUF file at `path`, atomically; returns the path.

    Every metadata key of the source file is copied with its exact type and in its order;
    `metadata` adds keys or overrides values (typed like the key it replaces; new ints are
    UINT32, floats FLOAT32; pass a `MetaValue` (or a `gguf.GGUFValue`) to choose the type).
    Every tensor is written from its current in-memory bytes. The file is read back as a model
    before it replaces anything (a Model's: the loader's structural checks; another GGUF
    description's: the GGUF reader). Raises `SaveError` with one clear line (the destination
    is then untouched: a previous file there stays as it was).
    """
    source = model.file  # a GGUFFile, or the in-memory description of a model built in Python
    meta = metadata_to_save(source.metadata, metadata)
    n_dims_in_file = source.tensor_n_dims
    tensors = [tensor_out(name, t, n_dims_in_file.get(name)) for name, t in model.tensors.items()]
    validate = read_back_model if isinstance(model, Model) else read_back_gguf
    return write_atomically(meta, tensors, Path(path), "model", validate)


def write_atomically(metadata: Mapping[str, MetaValue], tensors: list[TensorOut], dest: Path,
                     what: str, validate: Callable[[Path], object] = read_back_written) -> Path:
    """Write a GGUF file atomically (llamapy.atomic: a temp file beside `dest`, fsync, read back
    by `validate`, rename). The default reads it back with the GGUF reader, and with the model
    loader's checks when it is a model llamapy runs (llamapy.read_back.read_back_written)."""
    return replace_atomically(dest, lambda out: write_gguf(out, metadata, tensors), what, validate)
