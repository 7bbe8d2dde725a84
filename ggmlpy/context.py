"""ggml's context (ggml_context): the place tensors are created.

Only that: it holds no model, cache or graphs (unlike an inference context such as
llama.cpp's llama_context, which creates its tensors in contexts of this kind).

With `no_alloc=True` (the default, as in llama.cpp's graph building) tensors only get
metadata and are placed later by a graph allocator or bound to external memory (a
memory-mapped model). With `no_alloc=False` each new tensor gets zeroed bytes of its
own, which suits weights, optimizer state and tests.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .tensor import MAX_DIMS, Tensor
from .types import GGMLType, traits


class Context:
    def __init__(self, no_alloc: bool = True) -> None:
        self.no_alloc = no_alloc
        self.tensors: list[Tensor] = []

    def add(self, tensor: Tensor) -> Tensor:
        self.tensors.append(tensor)
        return tensor

    def new_tensor(self, type: GGMLType, ne: Sequence[int], name: str = "") -> Tensor:
        if not 1 <= len(ne) <= MAX_DIMS:
            raise ValueError(f"a tensor has 1..{MAX_DIMS} dimensions, got {len(ne)}")
        full = tuple(ne) + (1,) * (MAX_DIMS - len(ne))
        tensor = Tensor(type, full, name=name)
        if not self.no_alloc:
            tensor.bind(np.zeros(max(tensor.nbytes(), 1), dtype=np.uint8))
        return self.add(tensor)

    def new_tensor_1d(self, type: GGMLType, ne0: int, name: str = "") -> Tensor:
        return self.new_tensor(type, (ne0,), name)

    def new_tensor_2d(self, type: GGMLType, ne0: int, ne1: int, name: str = "") -> Tensor:
        return self.new_tensor(type, (ne0, ne1), name)

    def new_tensor_3d(self, type: GGMLType, ne0: int, ne1: int, ne2: int, name: str = "") -> Tensor:
        return self.new_tensor(type, (ne0, ne1, ne2), name)

    def new_tensor_4d(self, type: GGMLType, ne0: int, ne1: int, ne2: int, ne3: int, name: str = "") -> Tensor:
        return self.new_tensor(type, (ne0, ne1, ne2, ne3), name)

    def from_numpy(self, values: np.ndarray, type: GGMLType = GGMLType.F32, name: str = "") -> Tensor:
        """A tensor holding a copy of `values` (numpy shape is ne reversed).

        For a block-quantized `type`, `values` are the packed rows: uint8 of numpy shape
        (..., row bytes), as gguf.quants.quantize returns them.
        """
        values = np.asarray(values)
        ne = values.shape[::-1] if values.ndim else (1,)
        tr = traits(type)
        if tr.is_quantized:
            if values.dtype != np.uint8 or values.ndim == 0 or values.shape[-1] % tr.type_size:
                raise ValueError(f"{tr.name} rows must be uint8 of shape (..., k * {tr.type_size})")
            ne = (values.shape[-1] // tr.type_size * tr.blck_size,) + ne[1:]
        tensor = Tensor(type, tuple(ne) + (1,) * (MAX_DIMS - len(ne)), name=name)
        tensor.bind(np.zeros(max(tensor.nbytes(), 1), dtype=np.uint8))
        tensor.set(values)
        return self.add(tensor)
