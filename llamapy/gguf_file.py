"""Opening GGUF files: metadata and memory-mapped tensors, with one clear error per failure."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ggmlpy import GGMLType, Tensor

from .errors import ModelLoadError, UnsupportedModelError


class GGUFFile:
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
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the gguf package raises many types on damaged files
            raise ModelLoadError(f"{self.path} is damaged or truncated ({type(e).__name__}: {e})") from None
        self.tensors: dict[str, Tensor] = {}
        file_size = self.path.stat().st_size
        for rt in self.reader.tensors:
            try:
                ggml_type = GGMLType(int(rt.tensor_type))
            except ValueError:
                raise UnsupportedModelError(f"{self.path}: tensor {rt.name} has unknown type {int(rt.tensor_type)}") from None
            ne = tuple(int(n) for n in rt.shape) + (1,) * (4 - len(rt.shape))
            tensor = Tensor(ggml_type, ne, name=rt.name)
            if rt.data_offset + tensor.nbytes() > file_size:
                raise ModelLoadError(f"{self.path} is truncated: tensor {rt.name} extends past the end of the file")
            tensor.bind(self.reader.data, int(rt.data_offset))
            self.tensors[rt.name] = tensor

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, decoded on demand (token lists are large: only the vocab reads them)."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if not self.has(key):
            raise UnsupportedModelError(f"{self.path}: required metadata key {key!r} is missing")
        return self.get(key)

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise UnsupportedModelError(f"{self.path}: required tensor {name!r} is missing") from None

    @property
    def mapped_bytes(self) -> np.ndarray:
        return self.reader.data
