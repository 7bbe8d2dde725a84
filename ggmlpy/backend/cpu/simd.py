"""ggml-cpu's vector arithmetic, rounding for rounding, as numba scalar code.

llama.cpp's CPU kernels sum in orders fixed by their SIMD registers: 8 float lanes
accumulated separately and then added pairwise (AVX's hsum), 16 lanes reduced the way
GCC's _mm512_reduce_add_ps does, exp computed by a polynomial and a scalef. Reproducing
those orders makes llamapy's numbers llama.cpp's bit for bit; any other order differs by
an ulp here and there, and on a model like Gemma 3 an ulp anywhere grows, through the 8-bit
rounding of the next product's activations, into a different perplexity (about 0.1%, the
noise of a 20-chunk run) and different greedy text.

The reference is ggml-cpu as built for x86 with AVX-512 (the `-march=native` build of
llama.cpp on the machines these numbers come from); the AVX2 build sums softmax and F16
dot products over 8 lanes instead of 16. Everything here is plain float32 arithmetic, so
llamapy gives the same results on every CPU.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ...llvmir.scalar import fma_f32

F32 = np.float32


@njit(cache=True, inline="always")
def hsum8(a0, a1, a2, a3, a4, a5, a6, a7):
    """The sum of 8 float lanes as AVX's hsum_float_8 / tinyBLAS's hsum(__m256) add them:
    high half onto low half, then (0 + 2) + (1 + 3)."""
    t0 = a0 + a4
    t1 = a1 + a5
    t2 = a2 + a6
    t3 = a3 + a7
    return (t0 + t2) + (t1 + t3)


@njit(cache=True, inline="always")
def reduce16(p, o):
    """p[o] + ... + p[o + 15] as GCC's _mm512_reduce_add_ps adds 16 lanes: upper 8 onto
    lower 8, upper 4 onto lower 4, then (0 + 2) + (1 + 3)."""
    t0 = p[o] + p[o + 8]
    t1 = p[o + 1] + p[o + 9]
    t2 = p[o + 2] + p[o + 10]
    t3 = p[o + 3] + p[o + 11]
    t4 = p[o + 4] + p[o + 12]
    t5 = p[o + 5] + p[o + 13]
    t6 = p[o + 6] + p[o + 14]
    t7 = p[o + 7] + p[o + 15]
    u0 = t0 + t4
    u1 = t1 + t5
    u2 = t2 + t6
    u3 = t3 + t7
    return (u0 + u2) + (u1 + u3)


# ggml_v_expf's constants (vec.h): round-to-integer shifter, log2(e), ln 2 in two parts, and
# the polynomial of 2^f.
_EXP_SHIFT = F32(float.fromhex("0x1.8p23"))
_EXP_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_EXP_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))
_EXP_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C0, _EXP_C1, _EXP_C2, _EXP_C3, _EXP_C4 = (F32(float.fromhex(h)) for h in (
    "0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1"))
_EXP_RANGE = F32(192.0)


@njit(cache=True, inline="always")
def expf_avx512(x):
    """ggml_v_expf for __m512: n = round(x / ln 2), the polynomial j of the remainder, and
    j * 2^n by scalef (one rounding, subnormals included); 0 for n < -192 (and -inf),
    inf for n > 192, NaN for NaN. Written without branches (n clamped to +-193, the
    ends selected), so that loops over it vectorise."""
    z = fma_f32(x, _EXP_LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma_f32(-n, _EXP_LN2_LO, fma_f32(-n, _EXP_LN2_HI, x))
    u = b * b
    j = fma_f32(fma_f32(fma_f32(_EXP_C0, b, _EXP_C1), u, fma_f32(_EXP_C2, b, _EXP_C3)), u,
                fma_f32(_EXP_C4, b, F32(1.0)))
    nc = min(max(n, -_EXP_RANGE - F32(1.0)), _EXP_RANGE + F32(1.0))
    two_n = np.int64((np.int64(nc) + 1023) << 52).view(np.float64)  # 2^nc, |nc| <= 193
    r = F32(np.float64(j) * two_n)  # j * 2^n exact in double, rounded once (scalef)
    r = F32(0.0) if n < -_EXP_RANGE else r  # x = -inf: n = -inf, j NaN
    r = F32(np.inf) if n > _EXP_RANGE else r  # x = inf: j NaN
    return n if n != n else r  # NaN in, NaN out (scalef's)


@njit(cache=True, inline="always")
def expf(x):
    """libm's expf, which ggml calls outside its vector loops (the flash-attention rescale,
    softmax tails): numba's float32 exp is the same C library call."""
    return F32(math.exp(x))
