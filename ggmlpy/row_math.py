"""The scalar and row primitives every row kernel builds on: ggml's vectorisable expf and
sums in double, in row order or in lanes. Below both the CPU backend's kernels and
rowops.py (host-side rows), so the two give the same bits without rowops reaching into
the backend.
"""
from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32

# ggml_v_expf's constants (ggml-cpu/vec.h): round-to-integer shifter, log2(e), ln2 split
# in two, and the degree-5 polynomial of 2^f.
_EXP_SHIFT = F32(float.fromhex("0x1.8p23"))
_EXP_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_EXP_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))
_EXP_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C = tuple(F32(float.fromhex(h)) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3",
                                               "0x1.fffdb6p-2", "0x1.ffffecp-1"))


EXP_MAX = F32(88.0)  # exp_f32 is valid up to here (exp(88) = 1.65e38); callers clamp


@njit(cache=True, inline="always")
def exp_f32(x):
    """expf as ggml vectorises it (range reduction + polynomial, no libm call), so loops over
    it vectorise; inputs below -87 (including -inf) give 0, as softmax needs."""
    z = x * _EXP_LOG2E + _EXP_SHIFT
    n = z - _EXP_SHIFT
    b = x - n * _EXP_LN2_HI - n * _EXP_LN2_LO
    k = np.int32((np.float32(z).view(np.int32) << 23) + 0x3F800000).view(np.float32)
    u = b * b
    c0, c1, c2, c3, c4 = _EXP_C
    j = ((c0 * b + c1) * u + (c2 * b + c3)) * u + c4 * b
    return F32(0.0) if x < F32(-87.0) else j * k + k


# Row reductions. `reassoc` lets LLVM split a sum into vector lanes by element position, so
# a row's result does not change when masked (zero) entries follow it; the exp stays in
# functions without fast-math, where ggml_v_expf's rounding trick must survive.
_REDUCE = {"nsz", "reassoc"}


@njit(cache=True, fastmath=_REDUCE)
def sum_f64(v):
    s = 0.0
    for i in range(v.shape[0]):
        s += np.float64(v[i])
    return s


@njit(cache=True, fastmath=_REDUCE)
def sum_sq_f64(v):
    """sum of v[i] * v[i] (float32 products, as ggml's norms) in double."""
    s = 0.0
    for i in range(v.shape[0]):
        s += np.float64(v[i] * v[i])
    return s


@njit(cache=True, fastmath=_REDUCE)
def dot_f64(a, b):
    s = 0.0
    for i in range(a.shape[0]):
        s += np.float64(a[i]) * np.float64(b[i])
    return s


@njit(cache=True)
def max_f32(v):
    m = F32(-np.inf)
    for i in range(v.shape[0]):
        m = max(m, v[i])
    return m


