"""Tensor element types with ggml's ids and block geometry.

Type traits are one table: adding a quantized type later is one row here plus its
kernels, never a new branch in generic code.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class GGMLType(IntEnum):
    """ggml's `enum ggml_type` (same integer ids, so GGUF type fields map directly)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ4_NL = 20
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30


@dataclass(frozen=True)
class TypeTraits:
    """Geometry of one type: `blck_size` elements are stored in `type_size` bytes.

    `np_dtype` is the numpy element type for element-addressable types, and `None`
    for block-quantized ones, whose rows are handled as raw bytes by their kernels.
    BF16 is stored as uint16 bit patterns (numpy has no bfloat16).
    """

    name: str
    blck_size: int
    type_size: int
    np_dtype: np.dtype | None

    @property
    def is_quantized(self) -> bool:
        return self.np_dtype is None


def _plain(name: str, dtype) -> TypeTraits:
    dt = np.dtype(dtype)
    return TypeTraits(name, 1, dt.itemsize, dt)


TYPE_TRAITS: dict[GGMLType, TypeTraits] = {
    GGMLType.F32: _plain("f32", np.float32),
    GGMLType.F16: _plain("f16", np.float16),
    GGMLType.BF16: _plain("bf16", np.uint16),
    GGMLType.F64: _plain("f64", np.float64),
    GGMLType.I8: _plain("i8", np.int8),
    GGMLType.I16: _plain("i16", np.int16),
    GGMLType.I32: _plain("i32", np.int32),
    GGMLType.I64: _plain("i64", np.int64),
    # block-quantized types (ggml-common.h): kernels in ggmlpy/quants
    GGMLType.Q4_0: TypeTraits("q4_0", 32, 18, None),
    GGMLType.Q4_1: TypeTraits("q4_1", 32, 20, None),
    GGMLType.Q5_0: TypeTraits("q5_0", 32, 22, None),
    GGMLType.Q5_1: TypeTraits("q5_1", 32, 24, None),
    GGMLType.Q8_0: TypeTraits("q8_0", 32, 34, None),
    GGMLType.Q2_K: TypeTraits("q2_K", 256, 84, None),
    GGMLType.Q3_K: TypeTraits("q3_K", 256, 110, None),
    GGMLType.Q4_K: TypeTraits("q4_K", 256, 144, None),
    GGMLType.Q5_K: TypeTraits("q5_K", 256, 176, None),
    GGMLType.Q6_K: TypeTraits("q6_K", 256, 210, None),
    GGMLType.Q8_K: TypeTraits("q8_K", 256, 292, None),
    GGMLType.IQ4_NL: TypeTraits("iq4_nl", 32, 18, None),
}


def traits(t: GGMLType) -> TypeTraits:
    try:
        return TYPE_TRAITS[t]
    except KeyError:
        raise NotImplementedError(f"ggml type {GGMLType(t).name} is not supported yet") from None


def row_size(t: GGMLType, ne0: int) -> int:
    """Bytes in one row of `ne0` elements (ne0 must be a multiple of the block size)."""
    tr = traits(t)
    if ne0 % tr.blck_size:
        raise ValueError(f"row of {ne0} elements is not a multiple of {tr.name}'s block size {tr.blck_size}")
    return ne0 // tr.blck_size * tr.type_size


def type_from_name(name: str) -> GGMLType:
    """'f16' / 'F16' / 'q8_0' -> GGMLType, for command-line options."""
    for t, tr in TYPE_TRAITS.items():
        if tr.name.lower() == name.lower():
            return t
    raise ValueError(f"unknown tensor type {name!r}")
