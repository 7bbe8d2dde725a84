"""Scalar helpers shared by the block kernels: fp16 fields (as bytes) and ggml's rounding.

numba has no float16 arithmetic, so half-precision fields are read and written as
their bit patterns (ggmlpy.half). Every helper reproduces ggml's float32 arithmetic exactly.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..half import f16_bits_to_f32, f32_to_f16_bits

F32 = np.float32
QK_K = 256
K_SCALE_SIZE = 12


@njit(cache=True, inline="always")
def f16_to_f32(lo, hi):
    """The float32 value of the fp16 whose little-endian bytes are (lo, hi); exact."""
    return f16_bits_to_f32(np.uint16(lo) | (np.uint16(hi) << np.uint16(8)))


@njit(cache=True, inline="always")
def f16_round(f):
    """float32 f rounded through fp16 (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(f)))."""
    return f16_bits_to_f32(f32_to_f16_bits(f))


@njit(cache=True, inline="always")
def put_f16(out, o, f):
    h = f32_to_f16_bits(f)
    out[o] = np.uint8(h & 0xFF)
    out[o + 1] = np.uint8(h >> 8)


@njit(cache=True, inline="always")
def nearest_int(fval):
    """ggml's nearest_int: round half to even through the float32 magic-number trick."""
    val = F32(fval) + F32(12582912.0)
    i = np.int64(F32(val).view(np.int32))
    return np.int32((i & 0x007FFFFF) - 0x00400000)


@njit(cache=True, inline="always")
def roundf(x):
    """C roundf: halves away from zero."""
    a = math.floor(abs(np.float64(x)) + 0.5)
    return -a if x < 0 else a
