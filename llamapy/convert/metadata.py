"""The GGUF metadata a conversion writes, built key by key in llama.cpp's order.

llama.cpp's gguf writer keeps keys in the order they are first added, and a key added again
keeps its place with the new value; `Meta` does the same, so a converted file lists its keys
as convert_hf_to_gguf.py's does. Each `add_*` names the GGUF value type convert writes.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llamapy.errors import CheckpointError
from llamapy.gguf_file import FLOAT32_MAX, MetaValue, ValueType

from .config import shown
from .json_file import read_json


class Meta(dict):
    """Ordered GGUF metadata: key -> MetaValue."""

    def add(self, key: str, vtype: ValueType, value: object) -> None:
        self[key] = MetaValue(vtype, None, value)

    def u32(self, key: str, value: int) -> None:
        self.add(key, ValueType.UINT32, int(value))

    def i32(self, key: str, value: int) -> None:
        self.add(key, ValueType.INT32, int(value))

    def f32(self, key: str, value: float) -> None:
        self.add(key, ValueType.FLOAT32, float(value))

    def bool(self, key: str, value: bool) -> None:
        self.add(key, ValueType.BOOL, bool(value))

    def string(self, key: str, value: str | bytes) -> None:
        """A string value; an empty one is not written (as gguf's add_string)."""
        if value:
            self.add(key, ValueType.STRING, value)

    def array(self, key: str, item: ValueType, values: Sequence | np.ndarray) -> None:
        """An array value; an empty one is not written (as gguf's add_array)."""
        if len(values):
            if item != ValueType.STRING:
                values = np.asarray(values, dtype={ValueType.INT32: np.int32, ValueType.FLOAT32: np.float32,
                                                   ValueType.UINT32: np.uint32, ValueType.BOOL: np.bool_}[item])
            self[key] = MetaValue(ValueType.ARRAY, item, values)


def size_label(n_params: int) -> str:
    """A parameter count as llama.cpp names a model's size: 202K, 10M, 1.5B (two digits at least)."""
    for limit, scale, suffix in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M")):
        if n_params > limit:
            break
    else:
        scale, suffix = 1e-3, "K"
    scaled = n_params * scale
    decimals = max(2 - len(str(round(scaled)).lstrip("0")), 0)
    return f"{scaled:.{decimals}f}{suffix}"


def model_title(model_id: str) -> str:
    """A model id's name part as a title ("tiny-llama-v2" -> "Tiny Llama v2"): each lowercase
    word capitalised unless it is a version or starts with a digit (gguf-py's id_to_title)."""
    words = model_id.strip().replace("-", " ").split()
    return " ".join(w.title() if w.islower() and not re.match(r"^(v\d+(?:\.\d+)*|\d.*)$", w) else w for w in words)


# generation_config.json -> general.sampling.* (gguf-py's Metadata.load): key, value type, sources
_SAMPLING = (("sequence", ValueType.STRING, ("sequence",)), ("top_k", ValueType.INT32, ("top_k",)),
             ("top_p", ValueType.FLOAT32, ("top_p",)), ("min_p", ValueType.FLOAT32, ("min_p",)),
             ("xtc_probability", ValueType.FLOAT32, ("xtc_probability",)),
             ("xtc_threshold", ValueType.FLOAT32, ("xtc_threshold",)), ("temp", ValueType.FLOAT32, ("temperature",)),
             ("penalty_last_n", ValueType.INT32, ("penalty_last_n",)),
             ("penalty_repeat", ValueType.FLOAT32, ("penalty_repeat", "repetition_penalty")),
             ("mirostat", ValueType.INT32, ("mirostat",)), ("mirostat_tau", ValueType.FLOAT32, ("mirostat_tau",)),
             ("mirostat_eta", ValueType.FLOAT32, ("mirostat_eta",)))


def generation_config(path: Path) -> dict:
    """generation_config.json ({} when absent), its sampling values checked: each one of the
    GGUF type it is written as (a whole number in int32, a finite float32, a string), so a bad
    one is a line naming the key rather than a file that cannot hold it."""
    if not path.is_file():
        return {}
    config = read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    for _, vtype, sources in _SAMPLING:
        for key in sources:
            if config.get(key) is not None and not _fits(config[key], vtype):
                kind = {ValueType.STRING: "a string", ValueType.INT32: "a whole number in int32's range"}.get(
                    vtype, "a finite number in float32's range")
                raise CheckpointError(f"{path}: {key} must be {kind}, not {shown(config[key])}")
    return config


def _fits(value: object, vtype: ValueType) -> bool:
    if vtype == ValueType.STRING:
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if vtype == ValueType.INT32:
        return isinstance(value, int) and -2**31 <= value < 2**31
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def add_general(meta: Meta, generation: dict, name: str, n_params: int) -> None:
    """The general.* keys after general.type: the sampling defaults of generation_config.json,
    the model's name and its size label."""
    for key, vtype, sources in _SAMPLING:
        value = next((generation[s] for s in sources if generation.get(s) is not None), None)
        if value is not None:
            meta.add(f"general.sampling.{key}", vtype, value if vtype == ValueType.STRING else
                     (float(value) if vtype == ValueType.FLOAT32 else int(value)))
    meta.string("general.name", name)
    if n_params > 0:
        meta.string("general.size_label", size_label(n_params))
