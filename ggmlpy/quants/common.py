"""Scalar helpers shared by the block kernels: ggml's fp16 conversions and rounding.

numba has no float16 arithmetic, so half-precision fields are read and written as
their bit patterns. Every helper reproduces ggml's float32 arithmetic exactly.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

F32 = np.float32
QK_K = 256
K_SCALE_SIZE = 12


@njit(cache=True, inline="always")
def f16_to_f32(lo, hi):
    """The float32 value of the fp16 whose little-endian bytes are (lo, hi); exact."""
    h = np.int64(lo) | (np.int64(hi) << 8)
    sign = (h >> 15) & 1
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = F32(m) * F32(5.960464477539063e-08)  # m * 2^-24, exact
        return -v if sign else v
    if e == 31:
        bits = (sign << 31) | 0x7F800000 | (m << 13)
    else:
        bits = (sign << 31) | ((e + 112) << 23) | (m << 13)
    return np.uint32(bits).view(np.float32)


@njit(cache=True, inline="always")
def f32_to_f16_bits(f):
    """fp16 bit pattern of float32 f, rounded to nearest even (as F16C / numpy do)."""
    x = np.int64(F32(f).view(np.uint32))
    sign = (x >> 16) & 0x8000
    a = x & 0x7FFFFFFF
    if a > 0x7F800000:  # nan: keep it quiet
        return np.uint16(sign | 0x7E00 | ((a >> 13) & 0x3FF))
    if a >= 0x477FF000:  # rounds to a magnitude >= 65520: inf
        return np.uint16(sign | 0x7C00)
    if a < 0x38800000:  # below the smallest normal half: subnormal or zero
        v = np.float64(abs(F32(f))) * 16777216.0  # |f| * 2^24, exact in double
        fl = math.floor(v)
        frac = v - fl
        q = np.int64(fl)
        if frac > 0.5 or (frac == 0.5 and (q & 1) == 1):
            q += 1
        return np.uint16(sign | q)
    h = (a - 0x38000000 + 0x0FFF + ((a >> 13) & 1)) >> 13
    return np.uint16(sign | h)


@njit(cache=True, inline="always")
def f16_round(f):
    """float32 f rounded through fp16 (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(f)))."""
    h = f32_to_f16_bits(f)
    return f16_to_f32(np.uint8(h & 0xFF), np.uint8(h >> 8))


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
