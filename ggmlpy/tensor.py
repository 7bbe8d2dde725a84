"""The tensor: ggml's metadata (type, ne, nb, op, src, view) plus where its bytes live.

As in ggml, `ne[i]` counts elements and `nb[i]` gives byte strides along dimension i,
with dimension 0 the fastest-varying. A tensor's bytes are `buffer[offset:...]`, where
`buffer` is a flat uint8 array (an arena, a memory-mapped file, or the tensor's own; a
view's are its source's, at view_offs);
`array()` exposes them as a numpy view of shape (ne3, ne2, ne1, ne0).
"""
from __future__ import annotations

import itertools
from enum import IntEnum, IntFlag, auto
from typing import Any

import numpy as np

from .types import GGMLType, row_size, traits

MAX_DIMS = 4


class Op(IntEnum):
    """Graph operations (ggml's `enum ggml_op`; unary and GLU variants flattened).

    What each one means to the allocator and to autodiff is in registry.py."""

    NONE = 0
    DUP = auto()
    ADD = auto()
    SUB = auto()
    MUL = auto()
    DIV = auto()
    SCALE = auto()
    SQR = auto()
    SQRT = auto()
    LOG = auto()
    EXP = auto()
    SUM = auto()
    SUM_ROWS = auto()
    MEAN = auto()
    REPEAT = auto()
    REPEAT_BACK = auto()
    NORM = auto()
    RMS_NORM = auto()
    RMS_NORM_BACK = auto()
    MUL_MAT = auto()
    OUT_PROD = auto()
    SET_ROWS = auto()
    GET_ROWS = auto()
    GET_ROWS_BACK = auto()
    CPY = auto()
    CONT = auto()
    RESHAPE = auto()
    VIEW = auto()
    PERMUTE = auto()
    TRANSPOSE = auto()
    SOFT_MAX = auto()
    FLASH_ATTN_EXT = auto()
    SOFT_MAX_BACK = auto()
    ROPE = auto()
    ROPE_BACK = auto()
    SILU = auto()
    SILU_BACK = auto()
    GELU = auto()
    SWIGLU = auto()
    GEGLU = auto()
    CROSS_ENTROPY_LOSS = auto()
    CROSS_ENTROPY_LOSS_BACK = auto()
    OPT_STEP_ADAMW = auto()
    OPT_STEP_SGD = auto()
    ACC = auto()
    ARGMAX = auto()
    COUNT_EQUAL = auto()
    GELU_BACK = auto()
    CONCAT = auto()
    TOP_K = auto()
    CUMSUM = auto()
    TOP_P_CUT = auto()
    MIN_P_CUT = auto()
    PENALTIES = auto()
    SAMPLE_DIST = auto()
    LINEAR_CROSS_ENTROPY = auto()
    LINEAR_CROSS_ENTROPY_BACK = auto()


class Flag(IntFlag):
    """ggml's tensor flags (same bit values)."""

    INPUT = 1
    OUTPUT = 2
    PARAM = 4
    LOSS = 8


def contiguous_strides(t: GGMLType, ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    tr = traits(t)
    nb0 = tr.type_size
    nb1 = row_size(t, ne[0])
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


_BINDING_IDS = itertools.count(1)
BINDINGS = 0  # the latest binding number given: unchanged means no tensor was bound since


class Tensor:
    """A node or leaf of a compute graph; see the module docstring for the layout."""

    __slots__ = ("type", "ne", "nb", "op", "op_params", "src", "view_src", "view_offs",
                 "flags", "name", "_buffer", "_offset", "binding", "__weakref__")

    def __init__(self, type: GGMLType, ne: tuple[int, int, int, int], nb: tuple[int, int, int, int] | None = None,
                 op: Op = Op.NONE, src: tuple["Tensor", ...] = (), op_params: tuple[Any, ...] = (),
                 view_src: "Tensor | None" = None, view_offs: int = 0, name: str = "") -> None:
        self.type = GGMLType(type)
        self.ne = tuple(int(n) for n in ne)
        self.nb = nb if nb is not None else contiguous_strides(self.type, self.ne)
        self.op = op
        self.src = src
        self.op_params = op_params
        self.view_src = view_src
        self.view_offs = view_offs
        self.flags = Flag(0)
        self.name = name
        self._buffer: np.ndarray | None = None
        self._offset = 0
        self.binding = 0  # which bind() placed the bytes (0: none): compute plans compare it

    # ---- geometry -------------------------------------------------------------------
    def nelements(self) -> int:
        ne = self.ne
        return ne[0] * ne[1] * ne[2] * ne[3]

    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    def n_dims(self) -> int:
        for i in range(MAX_DIMS - 1, 0, -1):
            if self.ne[i] > 1:
                return i + 1
        return 1

    def nbytes(self) -> int:
        """Bytes spanned from the first to one past the last element (ggml_nbytes)."""
        if any(n == 0 for n in self.ne):
            return 0
        tr = traits(self.type)
        if tr.blck_size == 1:
            size = tr.type_size
            for i in range(MAX_DIMS):
                size += (self.ne[i] - 1) * self.nb[i]
            return size
        size = self.ne[0] * self.nb[0] // tr.blck_size
        for i in range(1, MAX_DIMS):
            size += (self.ne[i] - 1) * self.nb[i]
        return size

    def is_contiguous(self) -> bool:
        """Rows packed one after another (ggml_is_contiguous: strides of size-1 dims don't matter)."""
        tr = traits(self.type)
        if self.ne[0] != tr.blck_size and self.nb[0] != tr.type_size:
            return False
        expected = row_size(self.type, self.ne[0])
        for i in range(1, MAX_DIMS):
            if self.ne[i] != 1 and self.nb[i] != expected:
                return False
            expected *= self.ne[i]
        return True

    def is_transposed(self) -> bool:
        return self.nb[0] > self.nb[1]

    # ---- flags ----------------------------------------------------------------------
    def set_flag(self, flag: Flag) -> "Tensor":
        self.flags |= flag
        return self

    def set_input(self) -> "Tensor":
        return self.set_flag(Flag.INPUT)

    def set_output(self) -> "Tensor":
        return self.set_flag(Flag.OUTPUT)

    def set_param(self) -> "Tensor":
        return self.set_flag(Flag.PARAM)

    def set_loss(self) -> "Tensor":
        return self.set_flag(Flag.LOSS)

    def set_name(self, name: str) -> "Tensor":
        self.name = name
        return self

    # ---- data -----------------------------------------------------------------------
    @property
    def has_data(self) -> bool:
        return self.buffer is not None

    @property
    def buffer(self) -> np.ndarray | None:
        return self._buffer if self.view_src is None else self.view_src._buffer

    @property
    def offset(self) -> int:
        return self._offset if self.view_src is None else self.view_src._offset + self.view_offs

    def bind(self, buffer: np.ndarray, offset: int = 0) -> None:
        """Place this tensor's bytes at `buffer[offset:]` (buffer: flat uint8 array). Every
        bind gets a new `binding` number, so plans prepared on the old bytes know they are stale."""
        global BINDINGS
        if self.view_src is not None:
            raise ValueError(f"tensor {self.name!r} is a view: its bytes are its source's")
        if offset + self.nbytes() > buffer.nbytes:
            raise ValueError(f"tensor {self.name!r} ({self.nbytes()} bytes at {offset}) does not fit a buffer of {buffer.nbytes}")
        self._buffer = buffer
        self._offset = offset
        self.binding = next(_BINDING_IDS)
        BINDINGS = self.binding

    def array(self) -> np.ndarray:
        """Numpy view of the data, shape (ne3, ne2, ne1, ne0) with ggml's strides.

        Block-quantized tensors are viewed as raw bytes, shape (ne3, ne2, ne1, row bytes).
        """
        if self.buffer is None:
            raise RuntimeError(f"tensor {self.name!r} has no data (not allocated)")
        tr = traits(self.type)
        if tr.is_quantized:
            shape = (self.ne[3], self.ne[2], self.ne[1], row_size(self.type, self.ne[0]))
            strides = (self.nb[3], self.nb[2], self.nb[1], 1)
            dtype = np.dtype(np.uint8)
        else:
            shape = self.ne[::-1]
            strides = self.nb[::-1]
            dtype = tr.np_dtype
        return np.ndarray(shape, dtype=dtype, buffer=self.buffer, offset=self.offset, strides=strides)

    def set(self, values: np.ndarray) -> "Tensor":
        """Copy values into the tensor; `values` must hold nelements() values."""
        dst = self.array()
        np.copyto(dst, np.asarray(values).reshape(dst.shape), casting="unsafe")
        return self

    def numpy(self) -> np.ndarray:
        """A copy of the data with numpy shape ne[n_dims-1], ..., ne[0]."""
        return np.array(self.array()).reshape(self.ne[: self.n_dims()][::-1])

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.type.name}, ne={self.ne}, op={self.op.name})"
